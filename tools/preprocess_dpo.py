"""Tokenize preference pairs for DPO (`--dpo`) into a preference set: the chat set files of
tools/preprocess_sft.py, documents alternating chosen, rejected, plus <output-prefix>_preference.json
(data/preference.py).

Input: jsonl files of {"prompt", "chosen", "rejected"} records, each a string or a list of
{"role", "content"} messages (optionally "tools" and tool calls, as in SFT), rendered with the chat template of --tokenizer-model (the
checkpoint's tokenizer folder): each reply after the prompt as one conversation, the reply's
assistant messages and their end-of-turn tokens learned, as in SFT (data/preference.py;
docs/post_training.md compares with TRL's DPOTrainer). Records that cannot train (bad
JSON, missing fields, over-long with --overlong drop) are skipped, counted by reason and listed
with their file and line in <output-prefix>_skipped.txt; truncated ones (keep the start, as TRL)
are kept.

    python tools/preprocess_dpo.py --input prefs.jsonl --output-prefix out/prefs \\
        --tokenizer-model ckpt/hf_tokenizer --seq-length 2048
"""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import numpy as np

from megazoo.data.chat import OVERLONG, ChatRenderer, ChatTemplateError, SkipRecord
from megazoo.data.indexed import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from megazoo.data.preference import render_pair, write_marker
from megazoo.data.sft_dataset import mask_prefix, token_prefix


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl files of preference records")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-model", required=True,
                   help="Hugging Face tokenizer folder with a chat template (the checkpoint's)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length: longer sequences are truncated or dropped")
    p.add_argument("--overlong", choices=OVERLONG, default="truncate",
                   help="what to do with a pair whose sequence exceeds --seq-length + 1 tokens")
    return p.parse_args(argv)


def preprocess(args) -> dict:
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path}: no such file")
    try:
        renderer = ChatRenderer.from_folder(args.tokenizer_model, overlong=args.overlong,
                                            max_tokens=args.seq_length + 1 if args.seq_length else None)
    except ChatTemplateError as e:
        raise SystemExit(str(e)) from None
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    tp, mp_ = token_prefix(args.output_prefix), mask_prefix(args.output_prefix)
    tokens = IndexedDatasetBuilder(bin_path(tp), dtype=optimal_dtype(len(renderer.tok)))
    masks = IndexedDatasetBuilder(bin_path(mp_), dtype=np.uint8)
    reasons, listed, kept = Counter(), [], 0
    try:
        for path in args.input:
            with open(path, encoding="utf-8") as f:
                for line, text in enumerate(f, 1):
                    if not text.strip():
                        continue
                    try:
                        record = json.loads(text)
                        if not isinstance(record, dict):
                            raise SkipRecord("not a JSON object")
                        pair = render_pair(renderer, record)
                    except json.JSONDecodeError as e:
                        note, pair = f"bad JSON ({e.msg})", None
                    except SkipRecord as e:
                        note, pair = str(e), None
                    else:
                        note = "truncated" if any(r.truncated for r in pair) else None
                    if note is not None:
                        reasons[note.split(" (")[0]] += 1
                        listed.append(f"{path}:{line}: {note}")
                    if pair is None:
                        continue
                    for r in pair:
                        tokens.add_document(r.tokens)
                        masks.add_document(r.assistant_mask)
                    kept += 1
    except BaseException:
        tokens.abort()
        masks.abort()
        raise
    tokens.finalize(idx_path(tp))
    masks.finalize(idx_path(mp_))
    with open(args.output_prefix + "_skipped.txt", "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in listed))
    summary = {"pairs": kept, "notes": dict(reasons), "listed_in": args.output_prefix + "_skipped.txt"}
    write_marker(args.output_prefix, {"pairs": kept, "tokenizer": os.path.abspath(args.tokenizer_model)})
    return summary


def main(argv=None) -> None:
    summary = preprocess(parse_args(argv))
    print(f"{summary['pairs']} preference pairs")
    for reason, n in sorted(summary["notes"].items()):
        print(f"  {n} {reason} (listed in {summary['listed_in']})")


if __name__ == "__main__":
    main()
