"""Token-id statistics of an indexed dataset, and the check of a dataset against a model's vocabulary.

``<prefix>.stats.json`` (a sidecar the preprocessor writes) records the smallest and largest token
id and the tokenizer that produced them. A dataset without one (older files, other tools) is
scanned once, in bounded memory, and the result cached beside it. The sidecar is keyed by the
.idx dtype, both file sizes and a content fingerprint (`data.indexed.dataset_fingerprint`), so a
relabelled or rewritten dataset, even one of the same size, is scanned again.

Before step 1, every --data-path prefix must fit the model: ids in [0, vocab_size) and an .idx
dtype that can hold the vocabulary. A mismatch is refused with both numbers and the tokenizer the
data was made with, instead of an `IndexError` hours in (tp = 1) or silent garbage (tp > 1).
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from megazoo.data.index_cache import barrier, is_first_rank, world_collectives
from megazoo.data.indexed import IndexedDataset, bin_path, dataset_fingerprint, idx_path

logger = logging.getLogger(__name__)

SCAN_CHUNK = 1 << 24  # tokens per scan step: bounded memory for any file size


class VocabularyMismatch(ValueError):
    """A dataset whose token ids do not fit the model; the message names both and the fix."""


def stats_path(prefix: str) -> str:
    return prefix + ".stats.json"


def _key(prefix: str, dtype) -> dict:
    return dict(dtype=np.dtype(dtype).name, bin_bytes=os.path.getsize(bin_path(prefix)),
                idx_bytes=os.path.getsize(idx_path(prefix)), fingerprint=dataset_fingerprint(prefix))


def current_stats(prefix: str) -> dict | None:
    """The sidecar when it still describes the files (same dtype, sizes and content
    fingerprint), else None; cheap (no scan)."""
    stats = read_stats(prefix)
    if stats is None:
        return None
    ds = IndexedDataset(prefix)
    try:
        key = _key(prefix, ds.dtype)
    finally:
        ds.close()
    return stats if all(stats.get(k) == v for k, v in key.items()) else None


def write_stats(prefix: str, dtype, min_id: int | None, max_id: int | None,
                tokenizer: dict | None = None) -> None:
    """Record a dataset's id range (and its tokenizer) beside it, atomically."""
    record = dict(_key(prefix, dtype), min_token_id=min_id, max_token_id=max_id, tokenizer=tokenizer)
    tmp = f"{stats_path(prefix)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, stats_path(prefix))


def read_stats(prefix: str) -> dict | None:
    try:
        with open(stats_path(prefix)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def scan(ds: IndexedDataset) -> tuple[int | None, int | None]:
    """(min, max) token id of a dataset's .bin, one bounded chunk at a time."""
    data = ds.all_tokens()
    lo = hi = None
    for start in range(0, len(data), SCAN_CHUNK):
        chunk = np.asarray(data[start:start + SCAN_CHUNK])
        a, b = int(chunk.min()), int(chunk.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return lo, hi


def token_stats(prefix: str) -> dict:
    """The sidecar's record when it still describes the files, else a fresh scan (cached)."""
    ds = IndexedDataset(prefix)
    try:
        stats = read_stats(prefix)
        key = _key(prefix, ds.dtype)
        if stats is not None and all(stats.get(k) == v for k, v in key.items()):
            return stats
        rewritten = stats is not None and stats.get("fingerprint") not in (None, key["fingerprint"])
        if rewritten:  # e.g. a re-tokenization of the same size: what made it is no longer known
            logger.warning("%s: the .bin/.idx changed since %s was written (%s, now %s); scanning "
                           "the token ids again, the tokenizer that made the data is unknown",
                           prefix, stats_path(prefix), stats.get("fingerprint"), key["fingerprint"])
        else:
            logger.info("%s: scanning token ids once (no current %s)", prefix, stats_path(prefix))
        lo, hi = scan(ds)
        tokenizer = stats.get("tokenizer") if stats and not rewritten and \
            stats.get("bin_bytes") == key["bin_bytes"] else None
        try:
            write_stats(prefix, ds.dtype, lo, hi, tokenizer)
        except OSError as e:
            logger.warning("%s: could not cache token statistics (%s); they are scanned at every start",
                           stats_path(prefix), e.strerror or e)
        return dict(key, min_token_id=lo, max_token_id=hi, tokenizer=tokenizer)
    finally:
        ds.close()


def describe_tokenizer(tokenizer: dict | None) -> str:
    if not tokenizer:
        return "an unrecorded tokenizer (the dataset predates the sidecar)"
    files = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in tokenizer.items()
                     if k in ("vocab_file", "merge_file", "tokenizer_model") and v)
    return f"--tokenizer-type {tokenizer.get('type')} {files}".strip() + \
        f" (vocabulary {tokenizer.get('vocab_size')})"


def check_vocabulary(prefixes: list[str], vocab_size: int) -> None:
    """Refuse datasets whose ids or .idx dtype do not fit a `vocab_size`-token model.

    Rank 0 scans datasets without a current sidecar first; the others then read its cache."""
    world = world_collectives()
    stats = [token_stats(p) for p in prefixes] if is_first_rank(world) else None
    barrier(world)
    if stats is None:
        stats = [token_stats(p) for p in prefixes]
    for prefix, st in zip(prefixes, stats):
        dtype = np.dtype(st["dtype"])
        if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab_size - 1:
            raise VocabularyMismatch(
                f"{idx_path(prefix)}: tokens stored as {dtype.name} cannot hold the ids of this "
                f"model's {vocab_size}-token vocabulary (up to {vocab_size - 1}); the .idx was "
                f"relabelled or written by another tool: run tools/preprocess_data.py again")
        lo, hi = st.get("min_token_id"), st.get("max_token_id")
        if hi is None:
            continue  # no tokens at all: the split builder says so
        if lo < 0 or hi >= vocab_size:
            made_with = describe_tokenizer(st.get("tokenizer"))
            raise VocabularyMismatch(
                f"{prefix}: token ids span [{lo}, {hi}], the model's vocabulary has {vocab_size} "
                f"entries (ids 0..{vocab_size - 1}); the data was made with {made_with}: train with "
                f"that tokenizer, or preprocess the corpus again with this model's tokenizer")


def merge_stats(prefixes: list[str], output_prefix: str) -> None:
    """The sidecar of a merged dataset from its inputs' (scanning inputs that have none)."""
    stats = [token_stats(p) for p in prefixes]
    lows = [s["min_token_id"] for s in stats if s.get("min_token_id") is not None]
    highs = [s["max_token_id"] for s in stats if s.get("max_token_id") is not None]
    tokenizers = {json.dumps(s.get("tokenizer"), sort_keys=True) for s in stats}
    write_stats(output_prefix, stats[0]["dtype"], min(lows, default=None), max(highs, default=None),
                stats[0].get("tokenizer") if len(tokenizers) == 1 else None)
