"""Tokenize chat data into indexed files: <output-prefix>_text_document.{bin,idx} (tokens) and
<output-prefix>_assistant_mask_document.{bin,idx} (uint8, 1 on assistant tokens), Megatron's MMIDIDX
layout, one conversation per document (data/sft_dataset.py reads them).

Input: jsonl files of {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"} records
(with tool use: a record-level "tools", assistant "tool_calls" and "tool" messages; docs/sft.md),
rendered with the chat template of --tokenizer-model (the checkpoint's tokenizer folder; see
data/chat.py for how the assistant spans are found). Workers render batches of lines in parallel;
results are written in input order.

Records that cannot train (bad JSON, no assistant turn, no generation span, over-long with
--overlong drop) are skipped; truncated ones are kept. Both are counted by reason and listed with
their file and line in <output-prefix>_skipped.txt.

    python tools/preprocess_sft.py --input chat.jsonl --output-prefix out/chat \\
        --tokenizer-model ckpt/hf_tokenizer --seq-length 2048 --workers 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from collections import Counter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are the parallelism

import numpy as np

from megazoo.data.chat import OVERLONG, ChatRenderer, ChatTemplateError, SkipRecord
from megazoo.data.indexed import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from megazoo.data.sft_dataset import mask_prefix, token_prefix

BATCH_LINES = 256
_renderer: ChatRenderer | None = None  # one per worker process, built by _init


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl files of conversations")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-model", required=True,
                   help="Hugging Face tokenizer folder with a chat template (the checkpoint's)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length: longer conversations are truncated or dropped")
    p.add_argument("--overlong", choices=OVERLONG, default="truncate",
                   help="what to do with a conversation over --seq-length + 1 tokens")
    p.add_argument("--workers", type=int, default=1, help="rendering processes (1: in this process)")
    return p.parse_args(argv)


def _init(folder: str, max_tokens: int | None, overlong: str) -> None:
    global _renderer
    _renderer = ChatRenderer.from_folder(folder, max_tokens=max_tokens, overlong=overlong)


def _render_batch(batch: list[tuple[str, int, str]]):
    """[(file, line, text)] -> [(file, line, tokens or None, mask or None, note or None)]: the
    conversations of a batch rendered and tokenized together (`ChatRenderer.render_batch`)."""
    out, records, where = [], [], []
    for name, line, text in batch:
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            out.append((name, line, None, None, f"bad JSON ({e.msg})"))
            continue
        if not isinstance(record, dict):
            out.append((name, line, None, None, "not a JSON object"))
            continue
        out.append(None)  # filled below, in input order
        records.append(record)
        where.append((len(out) - 1, name, line))
    for (slot, name, line), r in zip(where, _renderer.render_batch(records)):
        out[slot] = ((name, line, None, None, str(r)) if isinstance(r, SkipRecord) else
                     (name, line, r.tokens, r.assistant_mask, "truncated" if r.truncated else None))
    return out


def _batches(paths: list[str]):
    batch = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, 1):
                if text.strip():
                    batch.append((path, n, text))
                if len(batch) >= BATCH_LINES:
                    yield batch
                    batch = []
    if batch:
        yield batch


def preprocess(args) -> dict:
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path}: no such file")
    max_tokens = args.seq_length + 1 if args.seq_length else None
    try:
        _init(args.tokenizer_model, max_tokens, args.overlong)  # fails here, before any worker
    except ChatTemplateError as e:
        raise SystemExit(str(e)) from None
    vocab = len(_renderer.tok)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    tp, mp_ = token_prefix(args.output_prefix), mask_prefix(args.output_prefix)
    tokens = IndexedDatasetBuilder(bin_path(tp), dtype=optimal_dtype(vocab))
    masks = IndexedDatasetBuilder(bin_path(mp_), dtype=np.uint8)
    reasons, listed, kept, n_tokens, n_assistant = Counter(), [], 0, 0, 0
    # Forked workers start with this process's renderer (no second tokenizer load); elsewhere
    # each worker builds its own.
    fork = sys.platform == "linux"
    pool = (mp.get_context("fork" if fork else "spawn").Pool(
        args.workers, None if fork else _init, () if fork else (args.tokenizer_model, max_tokens, args.overlong))
            if args.workers > 1 else None)
    try:
        results = (pool.imap(_render_batch, _batches(args.input), chunksize=1) if pool
                   else map(_render_batch, _batches(args.input)))
        for batch in results:
            for name, line, t, m, note in batch:
                if note is not None:
                    reasons[note.split(" (")[0]] += 1
                    listed.append(f"{name}:{line}: {note}")
                if t is None:
                    continue
                tokens.add_document(t)
                masks.add_document(m)
                kept, n_tokens, n_assistant = kept + 1, n_tokens + len(t), n_assistant + int(m.sum())
    except BaseException:
        tokens.abort()
        masks.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    tokens.finalize(idx_path(tp))
    masks.finalize(idx_path(mp_))
    skipped_file = args.output_prefix + "_skipped.txt"
    with open(skipped_file, "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in listed))
    return {"conversations": kept, "tokens": n_tokens, "assistant_tokens": n_assistant,
            "notes": dict(reasons), "listed_in": skipped_file,
            "spans": _renderer.method}


def main(argv=None) -> None:
    summary = preprocess(parse_args(argv))
    print(f"{summary['conversations']} conversations, {summary['tokens']} tokens "
          f"({summary['assistant_tokens']} assistant; spans from {summary['spans']})")
    for reason, n in sorted(summary["notes"].items()):
        print(f"  {n} {reason} (listed in {summary['listed_in']})")


if __name__ == "__main__":
    main()
