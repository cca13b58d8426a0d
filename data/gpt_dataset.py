"""GPT pre-training samples over an IndexedDataset, with Megatron's indices and splits."""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass

import numpy as np

from megazoo.data.gpt_indices import build_gpt_indices
from megazoo.data.index_cache import CachedIndices
from megazoo.data.indexed import IndexedDataset, dataset_fingerprint, idx_path

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT_VERSION = 1  # bump when the index algorithm changes, so old caches are not reused


@dataclass(frozen=True)
class GPTDatasetConfig:
    seq_length: int
    seed: int = 1234
    cache_dir: str | None = None  # None: "<dir of the data prefix>/cache/GPTDataset_indices"
    add_extra_token: int = 1  # samples hold seq_length + 1 tokens: inputs and shifted labels


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalised train/valid/test fractions (missing parts are 0), in float64 as
    megatron-core normalises them."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise ValueError(f"split {split!r}: give up to three non-negative weights like '969,30,1'")
    parts += [0.0] * (3 - len(parts))
    weights = np.array(parts, dtype=np.float64)
    return (weights / np.sum(weights)).tolist()


def split_boundaries(fractions: list[float], num_elements: int) -> list[int]:
    """Sequence boundaries of the splits: split ``i`` is ``[bounds[i], bounds[i + 1])``.

    As megatron-core: each boundary is the cumulative fraction times the count, rounded (Python's
    round, half to even), so every split takes its share of the rounding."""
    bounds, cumulative = [0], 0.0
    for frac in fractions:
        cumulative += frac
        bounds.append(int(round(cumulative * float(num_elements))))
    return bounds


class GPTDataset:
    """Samples of ``seq_length + 1`` consecutive tokens of the shuffled document stream.

    ``documents`` are the sequence ids of this split. Item ``i`` is a dict with ``"tokens"``
    (int64 numpy, length ``seq_length + 1``); the model's inputs are ``tokens[:-1]`` and its
    labels ``tokens[1:]``.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        path_prefix: str,
        documents: np.ndarray,
        num_samples: int | None,
        config: GPTDatasetConfig,
        split_name: str = "train",
    ) -> None:
        self.indexed, self.config, self.split_name = indexed, config, split_name
        self.path_prefix = path_prefix
        documents = np.asarray(documents, dtype=np.int64)
        sizes = indexed.sequence_lengths
        tokens = int(np.sum(sizes[documents], dtype=np.int64)) if len(documents) else 0
        if tokens == 0:
            raise ValueError(
                f"{path_prefix}: the {split_name} split ({len(documents)} documents) has no tokens; "
                "use a larger corpus or give this split a larger share"
            )
        description = {
            "class": "GPTDataset",
            "version": INDEX_FORMAT_VERSION,
            "path_prefix": os.path.abspath(path_prefix),
            "idx_bytes": os.path.getsize(idx_path(path_prefix)),
            # same sizes, other tokens (a re-tokenization): the cached indices are stale
            "fingerprint": dataset_fingerprint(path_prefix),
            "sequences": len(sizes),
            "split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "documents_md5": hashlib.md5(documents.tobytes()).hexdigest(),
            "tokens": tokens,
            "num_samples": num_samples,
            "seq_length": config.seq_length,
            "seed": config.seed,
            "add_extra_token": config.add_extra_token,
        }
        cache_dir = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache", "GPTDataset_indices")
        self.cache = CachedIndices(cache_dir, f"GPTDataset-{split_name}", description, ("document_index", "sample_index", "shuffle_index"))

        def build() -> dict[str, np.ndarray]:
            doc, sample, shuffle = build_gpt_indices(
                sizes, documents, num_samples, config.seq_length, config.seed, config.add_extra_token
            )
            return {"document_index": doc, "sample_index": sample, "shuffle_index": shuffle}

        arrays = self.cache.build_or_load(build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        logger.info("%s %s: %d samples of %d tokens", path_prefix, split_name, len(self), config.seq_length + 1)

    @property
    def built_anew(self) -> bool:
        """True if this process built the indices, False if it reused the cache."""
        return self.cache.built_anew

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens_of_sample(self, sample: int) -> np.ndarray:
        """Tokens of unshuffled sample ``sample`` (the concatenation across documents)."""
        (beg_row, beg_off), (end_row, end_off) = self.sample_index[sample], self.sample_index[sample + 1]
        beg_row, beg_off, end_row, end_off = int(beg_row), int(beg_off), int(end_row), int(end_off)
        extra, docs, get = self.config.add_extra_token, self.document_index, self.indexed.get
        if beg_row == end_row:
            parts = [get(int(docs[beg_row]), beg_off, end_off - beg_off + extra)]
        else:
            parts = [get(int(docs[beg_row]), beg_off)]
            parts += [get(int(docs[r])) for r in range(beg_row + 1, end_row)]
            parts.append(get(int(docs[end_row]), 0, end_off + extra))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if idx < 0 or idx >= len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        return {"tokens": self.tokens_of_sample(int(self.shuffle_index[idx]))}


def build_split_datasets(
    path_prefix: str, split: str, num_samples: tuple[int | None, int | None, int | None], config: GPTDatasetConfig
) -> list[GPTDataset | None]:
    """Train/valid/test GPTDatasets of one prefix (None where the split is empty or not asked for)."""
    indexed = IndexedDataset(path_prefix)
    bounds = split_boundaries(parse_split(split), len(indexed))
    out: list[GPTDataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if bounds[i + 1] <= bounds[i] or num_samples[i] == 0:
            out.append(None)
            continue
        docs = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        out.append(GPTDataset(indexed, path_prefix, docs, num_samples[i], config, name))
    return out
