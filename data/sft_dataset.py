"""Chat fine-tuning samples from a preprocessed conversation set (tools/preprocess_sft.py).

On disk, two MMIDIDX pairs (data/indexed.py) with the same sequence lengths, one conversation per
document: ``<prefix>_text_document`` (token ids) and ``<prefix>_assistant_mask_document``
(uint8, 1 on the tokens the assistant produces, end-of-turn included).

A sample is ``seq_length + 1`` tokens (inputs and their labels shifted by one), one conversation
padded with the end-of-document id (`mode="padded"`; padding is never learned), or several
conversations packed back to back (`mode="packed"`), each sample then also carries
"document_ids" so attention and positions restart per conversation. A dataset holds the
conversations of one split (`documents`: indices in file order, as --split cuts them, Megatron's
`split_boundaries`), shuffled once with the seed (every pass over the set sees the same
samples); a sample is a function of (seed, index).
"""
from __future__ import annotations

import logging

import numpy as np

from megazoo.data.gpt_dataset import parse_split, split_boundaries
from megazoo.data.indexed import IndexedDataset, IndexedDatasetError

logger = logging.getLogger(__name__)
MODES = ("padded", "packed")


def token_prefix(prefix: str) -> str:
    return prefix + "_text_document"


def mask_prefix(prefix: str) -> str:
    return prefix + "_assistant_mask_document"


def open_pair(prefix: str) -> tuple[IndexedDataset, IndexedDataset]:
    """The token and mask datasets of a preprocessed conversation set, checked to match."""
    tokens, mask = IndexedDataset(token_prefix(prefix)), IndexedDataset(mask_prefix(prefix))
    if not np.array_equal(tokens.sequence_lengths, mask.sequence_lengths):
        raise IndexedDatasetError(f"{mask_prefix(prefix)}.idx: sequence lengths differ from "
                                  f"{token_prefix(prefix)}.idx; preprocess the set again")
    return tokens, mask


def pack_greedily(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of conversation indices (in the given order) whose lengths sum to <= capacity:
    next-fit, so a sample's conversations stay in shuffled order and packing is O(n)."""
    bins: list[list[int]] = []
    used = capacity + 1
    for i, n in enumerate(lengths):
        n = min(int(n), capacity)
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


class SFTDataset:
    """Samples {"tokens" [s+1], "assistant_mask" [s+1] (+ "document_ids" [s+1] when packed)}."""

    def __init__(self, prefix: str, seq_length: int, seed: int, *, pad_id: int, mode: str = "padded",
                 documents: np.ndarray | None = None, pair: tuple | None = None):
        """`documents`: the conversations of this split (default: all); `pair`: the opened
        `open_pair(prefix)`, shared by the splits of one set."""
        if mode not in MODES:
            raise ValueError(f"SFT sample mode must be one of {MODES}, got {mode!r}")
        self.tokens, self.mask = pair or open_pair(prefix)
        self.seq, self.pad_id, self.mode = seq_length, pad_id, mode
        if documents is None:
            documents = np.arange(len(self.tokens))
        order = np.asarray(documents, dtype=np.int64)[np.random.default_rng(seed).permutation(len(documents))]
        if mode == "padded":
            self.samples = [[int(i)] for i in order]
        else:
            bins = pack_greedily(self.tokens.sequence_lengths[order], seq_length + 1)
            self.samples = [[int(order[j]) for j in b] for b in bins]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def assistant_tokens(self) -> int:
        """Assistant tokens that enter a loss (the first token of a sample never is a label)."""
        return int(sum(self[i]["assistant_mask"][1:].sum() for i in range(len(self))))

    @property
    def conversations(self) -> list[int]:
        """The conversations this dataset holds (indices in the preprocessed set), sorted."""
        return sorted(c for sample in self.samples for c in sample)

    def empty_sample(self) -> dict:
        """A sample of padding alone (no counted token): fills an evaluation's last batch."""
        return self._sample([])

    def __getitem__(self, idx: int) -> dict:
        return self._sample(self.samples[idx])

    def _sample(self, conversations: list[int]) -> dict:
        n = self.seq + 1
        tokens = np.full(n, self.pad_id, dtype=np.int64)
        mask = np.zeros(n, dtype=np.uint8)
        docs = np.full(n, -1, dtype=np.int64)  # padding: a document of its own
        at = 0
        for d, conv in enumerate(conversations):
            t = np.asarray(self.tokens[conv][:n - at], dtype=np.int64)
            tokens[at:at + len(t)] = t
            mask[at:at + len(t)] = self.mask[conv][:len(t)]
            docs[at:at + len(t)] = d
            at += len(t)
        if self.mode == "packed":
            # A conversation's first token is not the label of the previous one's last token.
            starts = np.flatnonzero(np.diff(docs) != 0) + 1
            mask[starts] = 0
            docs[docs < 0] = len(conversations)
            return {"tokens": tokens, "assistant_mask": mask, "document_ids": docs}
        return {"tokens": tokens, "assistant_mask": mask}


def split_sft_datasets(prefix: str, split: str, seq_length: int, seed: int, *, pad_id: int,
                       mode: str = "padded") -> list[SFTDataset | None]:
    """Train/valid/test SFTDatasets of the conversations --split cuts (in file order, as
    pretraining cuts documents); None for a split without conversations."""
    pair = open_pair(prefix)
    bounds = split_boundaries(parse_split(split), len(pair[0]))
    out = [SFTDataset(prefix, seq_length, seed, pad_id=pad_id, mode=mode, pair=pair,
                      documents=np.arange(bounds[i], bounds[i + 1]))
           if bounds[i + 1] > bounds[i] else None for i in range(3)]
    logger.info("%s (--split %s): %s", prefix, split, ", ".join(
        f"{name} {bounds[i + 1] - bounds[i]} conversations ({len(d) if d else 0} {mode} samples)"
        for i, (name, d) in enumerate(zip(("train", "valid", "test"), out))))
    return out


class OnePass:
    """An SFT dataset's samples once, then empty ones up to `length` samples: an evaluation reads
    each held-out conversation once, its last global batch filled with samples that count no
    token."""

    def __init__(self, dataset: SFTDataset, length: int):
        self.dataset, self.length = dataset, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict:
        return self.dataset[idx] if idx < len(self.dataset) else self.dataset.empty_sample()
