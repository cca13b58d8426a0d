"""The three GPT dataset indices, numerically identical to Megatron's (numpy, no per-sample loop).

- document index: the split's document ids repeated once per epoch, shuffled with the shared
  ``RandomState(seed)``; when the last epoch is only partly used it is shuffled on its own, so
  its few documents are not scattered over every epoch.
- sample index: ``[num_samples + 1, 2]`` rows ``(position in the document index, token offset)``.
  Sample ``i`` spans rows ``i`` and ``i + 1``: ``seq_length + 1`` tokens that run across document
  boundaries; consecutive samples share one token (the last label is the next first input).
- shuffle index: a permutation of the samples, the partial last epoch again shuffled apart.

Megatron builds the sample index with a C++ loop (helpers.cpp ``build_sample_idx``); here each
boundary is located directly with ``searchsorted`` over the cumulative token counts, which gives
the same rows (tests/data/test_data_gpt_megatron_core.py checks it against that compiled loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The fraction of an epoch below which the last epoch is shuffled separately (Megatron's value).
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True)
class EpochPlan:
    tokens_per_epoch: int
    num_epochs: int
    separate_last_epoch: bool
    samples_before_last_epoch: int


def plan_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int = 1) -> EpochPlan:
    """How many passes over the split are needed for ``num_samples``, and whether the last is partial."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; check the split string and that the dataset is not empty")
    num_epochs = 1
    if num_samples is not None:
        wanted = num_samples * seq_length + add_extra_token
        num_epochs = max(1, -(-wanted // tokens_per_epoch))  # ceil: the smallest count reaching it
    if num_epochs == 1:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    before_last = ((num_epochs - 1) * tokens_per_epoch - add_extra_token) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - add_extra_token) // seq_length
    assert 0 <= from_last <= per_epoch + 1, (from_last, per_epoch)
    separate = from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(tokens_per_epoch, num_epochs, separate, before_last)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """Documents repeated ``num_epochs`` times, shuffled (the last epoch apart if asked)."""
    if not separate_last_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        # RandomState.shuffle permutes by position only, so the dtype does not change the order.
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: int = 1,
) -> np.ndarray:
    """Rows ``(document-index position, offset)`` at every sample boundary, as helpers.cpp makes them.

    Sample ``i`` starts at token ``i * seq_length`` of the document-index stream and consumes
    ``seq_length + add_extra_token`` tokens; the loop records the document holding its last token
    ``q`` and the offset just past it minus ``add_extra_token``. Locating ``q`` by binary search
    over cumulative lengths gives the same row without walking the documents one by one.
    """
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - add_extra_token) // seq_length
    else:
        num_samples = math.ceil((total - add_extra_token) / seq_length)
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    cum = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    if cum[-1] != total:
        raise ValueError(f"document index holds {cum[-1]} tokens, expected {total}")
    last_token = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + (add_extra_token - 1)
    past_end = last_token >= total  # only the partial final sample when it is kept
    q = np.minimum(last_token, total - 1)
    # side="right" skips empty documents, landing on the one that really holds token q.
    rows = np.searchsorted(cum, q, side="right") - 1
    offsets = q - cum[rows] + 1 - add_extra_token
    if past_end.any():
        rows[past_end] = len(document_index) - 1
        offsets[past_end] = int(sizes[document_index[-1]]) - add_extra_token
    fits32 = len(document_index) < 2**31 and int(np.max(sizes, initial=0)) < 2**31
    dtype = np.int32 if fits32 else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[0] = (0, 0)
    out[1:, 0] = rows
    out[1:, 1] = offsets
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, total_size)``: ``[0, num_samples)`` and the rest shuffled separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    add_extra_token: int = 1,
    drop_last_partial_sequence: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle indices for one split, in Megatron's RNG call order."""
    sizes = np.asarray(sizes)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    plan = plan_epochs(tokens_per_epoch, num_samples, seq_length, add_extra_token)
    rng = np.random.RandomState(seed)
    doc_index = build_document_index(documents, plan.num_epochs, rng, plan.separate_last_epoch)
    sample_index = build_sample_index(
        sizes, doc_index, seq_length, plan.num_epochs, tokens_per_epoch, drop_last_partial_sequence, add_extra_token
    )
    n = sample_index.shape[0] - 1
    first = plan.samples_before_last_epoch if plan.separate_last_epoch else n
    shuffle_index = build_shuffle_index(first, n, rng)
    return doc_index, sample_index, shuffle_index
