"""Tokenize a corpus into Megatron's indexed format: <output-prefix>_<key>_document.{bin,idx}.

Inputs (--input, one or more): jsonl files (plain or .gz; Megatron's loose-JSON .json too),
text files or folders of them (one document per file), globs, and local parquet/csv/arrow files
read through HF ``datasets``. Streaming and multiprocess: the main process reads records lazily,
workers parse and tokenize batches, at most a few batches are in flight, and results are written
in input order, so memory stays bounded whatever the corpus size.

Malformed records (bad JSON, missing keys, non-UTF-8 bytes) are skipped, counted and listed with
their line numbers in <output-prefix>_skipped.txt; --strict stops at the first one instead.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are the parallelism; no fork warnings

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megazoo.data import long_documents  # noqa: E402
from megazoo.data.long_documents import MAX_UNSLICED_CHARS, encode_long, too_long  # noqa: E402
from megazoo.data.indexed import IndexedDatasetBuilder, IndexedDatasetError, merge_datasets, optimal_dtype  # noqa: E402
from megazoo.data.token_stats import stats_path, write_stats  # noqa: E402
from megazoo.data.text_sources import DEFAULT_TEXT_SUFFIXES, CorruptInput, iter_records, parse_record, resolve_inputs  # noqa: E402
from megazoo.data.tokenizers import TokenizerError, build_tokenizer  # noqa: E402

# ~256 KB of input per task: large enough to amortise IPC, small enough that the last tasks
# (which leave the other workers idle) are short, and that memory stays bounded.
BATCH_BYTES = 1 << 18
BATCH_RECORDS = 512
SHOWN_BAD = 20  # malformed records echoed to the console; all of them go to the _skipped.txt file


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="files, folders or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys (columns) to tokenize")
    g.add_argument("--text-suffixes", default=",".join(DEFAULT_TEXT_SUFFIXES),
                   help="suffixes of text files taken from folders ('all' for every file)")
    g.add_argument("--strict", action="store_true", help="fail on the first malformed record instead of skipping it")
    g.add_argument("--max-unsliced-chars", type=int, default=MAX_UNSLICED_CHARS,
                   help="longest document for tokenizers that cannot be tokenized in slices (GPT-2 BPE "
                        "always can); longer ones are skipped and listed")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True,
                   help="GPT2BPETokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | HuggingFaceTokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model, tokenizer.json or tokenizer folder")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes, as Megatron's --workers (1: tokenize in the main process); "
                        "each runs the Rust tokenizer on one thread unless TOKENIZERS_PARALLELISM=true is set")
    g.add_argument("--partitions", type=int, default=1, help="process the input files in N groups, then merge")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress-bar updates")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (a summary is still printed)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker side
_WORKER: dict = {}


def _init_worker(tokenizer_kwargs: dict, json_keys: list[str], append_eod: bool,
                 max_unsliced: int = MAX_UNSLICED_CHARS) -> None:
    _WORKER.update(tok=build_tokenizer(**tokenizer_kwargs), keys=json_keys, append_eod=append_eod,
                   max_unsliced=max_unsliced)


@dataclass
class BatchResult:
    tokens: dict[str, np.ndarray]  # key -> flat int32 tokens of the batch's documents
    lengths: dict[str, np.ndarray]  # key -> per-document lengths
    docs: int = 0
    text_bytes: int = 0
    empty: list = field(default_factory=list)  # (source, line)
    bad: list = field(default_factory=list)  # (source, line, reason)


def _encode_texts(tok, texts: list[str]) -> list[np.ndarray]:
    """int32 ids per text: short texts in one batched call, long ones in bounded-memory slices."""
    out: list = [None] * len(texts)
    short = [i for i, t in enumerate(texts) if len(t) <= long_documents.SLICE_CHARS]
    batch = [texts[i] for i in short]
    ids = tok.encode_batch(batch) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in batch]
    for i, doc in zip(short, ids):
        out[i] = np.asarray(doc, dtype=np.int32)
    for i, t in enumerate(texts):
        if out[i] is None:
            out[i] = encode_long(tok, t, _WORKER["max_unsliced"])
    return out


def encode_batch(records: list) -> BatchResult:
    tok, keys, append_eod = _WORKER["tok"], _WORKER["keys"], _WORKER["append_eod"]
    texts: dict[str, list[str]] = {k: [] for k in keys}
    result = BatchResult({}, {})
    for record in records:
        parsed, nbytes, error = parse_record(record, keys)
        if error is None and parsed is not None:
            error = next(filter(None, (too_long(tok, t, _WORKER["max_unsliced"]) for t in parsed.values())), None)
        if error is not None:
            result.bad.append((record[1], record[2], error))
        elif parsed is not None:
            if not any(parsed.values()):
                result.empty.append((record[1], record[2]))
                continue
            for k in keys:
                texts[k].append(parsed[k])
            result.docs += 1
            result.text_bytes += nbytes
    eod = np.asarray([tok.eod], dtype=np.int32)
    for k in keys:
        ids = _encode_texts(tok, texts[k])
        result.lengths[k] = np.fromiter((len(d) + append_eod for d in ids), dtype=np.int32, count=len(ids))
        pieces = [piece for d in ids for piece in (d, eod)] if append_eod else ids
        result.tokens[k] = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)  # one copy
    return result


# ---------------------------------------------------------------- main side
def _batches(records):
    """Group (record, disk bytes) pairs into tasks of about BATCH_BYTES."""
    batch, disk = [], 0
    for record, done in records:
        batch.append(record)
        disk += done
        if disk >= BATCH_BYTES or len(batch) >= BATCH_RECORDS:
            yield batch, disk
            batch, disk = [], 0
    if batch:
        yield batch, disk


@dataclass
class Totals:
    docs: int = 0
    tokens: int = 0
    text_bytes: int = 0
    empty: int = 0
    bad: int = 0
    shown: list = field(default_factory=list)
    corrupt: str | None = None  # the input that could not be read to its end


class MalformedRecord(RuntimeError):
    pass


def _until_corrupt(records, totals):
    """The records, ending (not failing) at a corrupt input, which `totals.corrupt` then names:
    everything read before it is still tokenized and written."""
    try:
        yield from records
    except CorruptInput as e:
        totals.corrupt = str(e)


def _process_files(files, builders, args, pool, totals, bar, skipped_log) -> None:
    key0 = args.json_keys[0]

    def handle(result: BatchResult, disk: int) -> None:
        for source, line, reason in result.bad:
            where = f"{source}:{line}" if line is not None else source
            if args.strict:
                raise MalformedRecord(f"{where}: {reason}; fix the record or drop --strict to skip it")
            totals.bad += 1
            if len(totals.shown) < SHOWN_BAD:
                totals.shown.append(f"{where}: {reason}")
            skipped_log().write(f"{where}\t{reason}\n")
        for source, line in result.empty:
            totals.empty += 1
            skipped_log().write(f"{source}:{line}\tempty document\n" if line else f"{source}\tempty document\n")
        for k, b in builders.items():
            b.add_documents(result.tokens[k], result.lengths[k])
        totals.docs += result.docs
        totals.tokens += int(result.tokens[key0].size)
        totals.text_bytes += result.text_bytes
        if bar is not None:
            bar.update(disk)
            if totals.docs // args.log_interval != (totals.docs - result.docs) // args.log_interval or not result.docs:
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix(docs=totals.docs, docs_s=f"{totals.docs / elapsed:.0f}", tok_s=f"{totals.tokens / elapsed:.3g}", bad=totals.bad)

    records = _until_corrupt(iter_records(files, args.json_keys), totals)
    if pool is None:
        for batch, disk in _batches(records):
            handle(encode_batch(batch), disk)
        return
    pending: deque = deque()
    max_inflight = 4 * args.workers  # bounded: the reader never runs far ahead of the tokenizers
    for batch, disk in _batches(records):
        pending.append((pool.apply_async(encode_batch, (batch,)), disk))
        while len(pending) >= max_inflight:
            res, d = pending.popleft()
            handle(res.get(), d)
    while pending:
        res, d = pending.popleft()
        handle(res.get(), d)


def main(argv=None) -> int:
    args = get_args(argv)
    suffixes = None if args.text_suffixes == "all" else tuple(s if s.startswith(".") else "." + s for s in args.text_suffixes.split(","))
    tok_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    try:
        plan = resolve_inputs(args.input, suffixes)
        tokenizer = build_tokenizer(**tok_kwargs)
    except (FileNotFoundError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    dtype = optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        print(f"error: {_io_error(e, out_dir)}", file=sys.stderr)
        return 1
    final = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    n_parts = max(1, min(args.partitions, len(plan.files)))
    groups = [plan.files[i * len(plan.files) // n_parts:(i + 1) * len(plan.files) // n_parts] for i in range(n_parts)]
    part_prefixes = {k: [final[k] if n_parts == 1 else f"{final[k]}.part{i}" for i in range(n_parts)] for k in final}

    totals = Totals()
    log_path = args.output_prefix + "_skipped.txt"
    log_file = []

    def skipped_log():
        if not log_file:
            log_file.append(open(log_path, "w"))
        return log_file[0]

    print(f"input: {len(plan.files)} files, {plan.total_bytes / 1e6:.1f} MB"
          + (f" ({plan.filtered_out} files in folders skipped by suffix)" if plan.filtered_out else "")
          + f"; tokenizer {args.tokenizer_type} (vocab {tokenizer.vocab_size}, {np.dtype(dtype).name} tokens)")
    pool = None
    if args.workers > 1:
        pool = mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(
            args.workers, initializer=_init_worker, initargs=(tok_kwargs, args.json_keys, args.append_eod, args.max_unsliced_chars))
    else:
        _init_worker(tok_kwargs, args.json_keys, args.append_eod, args.max_unsliced_chars)
    bar = None if args.no_progress else tqdm(total=plan.total_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                                             desc="tokenizing", dynamic_ncols=True)
    t0 = time.perf_counter()
    builders: dict[str, IndexedDatasetBuilder] = {}
    id_ranges: dict[str, list[int]] = {k: [] for k in final}
    try:
        for i, files in enumerate(groups):
            builders = {k: IndexedDatasetBuilder(part_prefixes[k][i] + ".bin", dtype=dtype) for k in final}
            _process_files(files, builders, args, pool, totals, bar, skipped_log)
            for k, b in builders.items():
                b.finalize(part_prefixes[k][i] + ".idx")
                id_ranges[k] += [x for x in (b.min_id, b.max_id) if x is not None]
            builders = {}
            if totals.corrupt:  # keep what was read; the files after it are not read
                part_prefixes = {k: v[:i + 1] for k, v in part_prefixes.items()}
                break
        if totals.docs == 0:
            raise IndexedDatasetError(
                f"{' '.join(args.input)}: no documents written ({totals.bad} malformed, {totals.empty} empty, "
                f"{len(plan.files)} files); check --input and --json-keys")
        if n_parts > 1:
            for k in final:
                merge_datasets(part_prefixes[k], final[k])
                for p in part_prefixes[k]:
                    os.remove(p + ".bin")
                    os.remove(p + ".idx")
        made_with = dict(type=args.tokenizer_type, vocab_size=tokenizer.vocab_size,
                         fingerprint=tokenizer.fingerprint(),
                         **{k: v for k, v in tok_kwargs.items() if k != "tokenizer_type"})
        for k in final:  # the id range, so that training can check it against the model's vocabulary
            write_stats(final[k], dtype, min(id_ranges[k], default=None), max(id_ranges[k], default=None),
                        made_with)
    except BaseException as e:  # includes Ctrl-C and worker failures: clean up, then report
        for b in builders.values():
            b.abort()
        for k in final:  # never leave a half-written dataset that looks complete
            for p in part_prefixes[k] + [final[k]]:
                for path in (p + ".bin", p + ".idx", stats_path(p)):
                    if os.path.exists(path):
                        os.remove(path)
        if isinstance(e, OSError):
            print(f"error: {_io_error(e, args.output_prefix)}; nothing written", file=sys.stderr)
            return 1
        if not isinstance(e, (MalformedRecord, IndexedDatasetError, KeyError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
        if log_file:
            log_file[0].close()
    elapsed = time.perf_counter() - t0
    print(f"wrote {', '.join(p + '.{bin,idx}' for p in final.values())}")
    print(f"{totals.docs} documents, {totals.tokens} tokens, {totals.text_bytes / 1e6:.1f} MB of text in {elapsed:.1f} s "
          f"({totals.text_bytes / 1e6 / elapsed:.2f} MB/s, {totals.tokens / elapsed:.0f} tokens/s, {totals.docs / elapsed:.0f} docs/s)")
    if totals.bad or totals.empty:
        print(f"skipped {totals.bad} malformed and {totals.empty} empty records; all listed in {log_path}")
        for line in totals.shown:
            print(f"  {line}")
        if totals.bad > len(totals.shown):
            print(f"  ... and {totals.bad - len(totals.shown)} more")
    if totals.corrupt:
        print(f"error: {totals.corrupt}; kept the {totals.docs} documents read before it, the "
              f"input files after it were not read", file=sys.stderr)
        return 1
    return 0


def _io_error(e: OSError, where: str) -> str:
    """One line for a failed read or write: the file and the reason."""
    return f"{e.filename or where}: {e.strerror or e}"


if __name__ == "__main__":
    sys.exit(main())
