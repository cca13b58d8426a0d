"""Chat fine-tuning samples from a preprocessed conversation set (tools/preprocess_sft.py).

On disk, two MMIDIDX pairs (data/indexed.py) with the same sequence lengths, one conversation per
document: ``<prefix>_text_document`` (token ids) and ``<prefix>_assistant_mask_document``
(uint8, 1 on the tokens the assistant produces, end-of-turn included).

A sample is ``seq_length + 1`` tokens (inputs and their labels shifted by one), one conversation
padded with the end-of-document id (`mode="padded"`; padding is never learned), or several
conversations packed back to back (`mode="packed"`), each sample then also carries
"document_ids" so attention and positions restart per conversation. Conversations are shuffled
once with the seed (every pass over the set sees the same samples); a sample is a function of
(seed, index).
"""
from __future__ import annotations

import numpy as np

from data.indexed import IndexedDataset, IndexedDatasetError

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

    def __init__(self, prefix: str, seq_length: int, seed: int, *, pad_id: int, mode: str = "padded"):
        if mode not in MODES:
            raise ValueError(f"SFT sample mode must be one of {MODES}, got {mode!r}")
        self.tokens, self.mask = open_pair(prefix)
        self.seq, self.pad_id, self.mode = seq_length, pad_id, mode
        order = np.random.default_rng(seed).permutation(len(self.tokens))
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

    def __getitem__(self, idx: int) -> dict:
        n = self.seq + 1
        tokens = np.full(n, self.pad_id, dtype=np.int64)
        mask = np.zeros(n, dtype=np.uint8)
        docs = np.full(n, -1, dtype=np.int64)  # padding: a document of its own
        at = 0
        for d, conv in enumerate(self.samples[idx]):
            t = np.asarray(self.tokens[conv][:n - at], dtype=np.int64)
            tokens[at:at + len(t)] = t
            mask[at:at + len(t)] = self.mask[conv][:len(t)]
            docs[at:at + len(t)] = d
            at += len(t)
        if self.mode == "packed":
            # A conversation's first token is not the label of the previous one's last token.
            starts = np.flatnonzero(np.diff(docs) != 0) + 1
            mask[starts] = 0
            docs[docs < 0] = len(self.samples[idx])
            return {"tokens": tokens, "assistant_mask": mask, "document_ids": docs}
        return {"tokens": tokens, "assistant_mask": mask}
