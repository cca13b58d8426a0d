"""The vectorised GPT indices against plain transcriptions of Megatron's algorithms."""
import math

import numpy as np
import pytest

from megazoo.data.gpt_indices import (
    build_document_index,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    plan_epochs,
)


def reference_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last=True, add_extra=1):
    """A direct Python transcription of helpers.cpp build_sample_idx (one document at a time)."""
    total = num_epochs * tokens_per_epoch - add_extra
    num_samples = total // seq_length if drop_last else math.ceil(total / seq_length)
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    row, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + add_extra
        while remaining != 0:
            length = int(sizes[doc_idx[row]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - add_extra
                remaining = 0
            else:
                if row == len(doc_idx) - 1:
                    assert s == num_samples
                    offset = int(sizes[doc_idx[row]]) - add_extra
                    break
                row += 1
                offset = 0
        out[s] = (row, offset)
    return out


def reference_document_index(documents, num_epochs, rng, separate_last):
    """Megatron's construction, literally (mgrid, then one shuffle per part)."""
    if not separate_last or num_epochs == 1:
        idx = np.mgrid[0:num_epochs, 0 : len(documents)][1]
        idx[:] = documents
        idx = idx.reshape(-1).astype(np.int32)
        rng.shuffle(idx)
        return idx
    first = reference_document_index(documents, num_epochs - 1, rng, False)
    last = reference_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


@pytest.mark.parametrize("case", range(60))
def test_sample_index_matches_reference_loop(case):
    rng = np.random.default_rng(case)
    n_docs = int(rng.integers(1, 40))
    sizes = rng.integers(0, 30, size=n_docs).astype(np.int32)  # includes empty documents
    sizes[rng.integers(0, n_docs)] += 1  # at least one token
    documents = np.arange(n_docs)
    seq_length = int(rng.integers(1, 50))
    num_epochs = int(rng.integers(1, 4))
    tokens = int(sizes.sum())
    add_extra = int(case % 3 != 0)  # mostly 1 (GPT), sometimes 0
    drop_last = case % 5 != 0
    if num_epochs * tokens - add_extra < seq_length and drop_last:
        num_epochs = seq_length // max(tokens, 1) + 2
    doc_idx = build_document_index(documents, num_epochs, np.random.RandomState(case), False)
    got = build_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens, drop_last, add_extra)
    want = reference_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens, drop_last, add_extra)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("epochs,separate", [(1, False), (3, False), (3, True)])
def test_document_index_matches_megatron_construction(epochs, separate):
    documents = np.arange(5, 25)
    got = build_document_index(documents, epochs, np.random.RandomState(7), separate)
    want = reference_document_index(documents, epochs, np.random.RandomState(7), separate)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


def test_shuffle_index_separate_tail():
    idx = build_shuffle_index(10, 14, np.random.RandomState(0))
    assert sorted(idx[:10].tolist()) == list(range(10)) and sorted(idx[10:].tolist()) == list(range(10, 14))
    assert idx.dtype == np.uint32


def test_epoch_plan():
    # 100 tokens per epoch, seq 10: 9 samples per epoch ((100-1)//10).
    assert plan_epochs(100, 5, 10).num_epochs == 1
    plan = plan_epochs(100, 21, 10)  # needs 211 tokens -> 3 epochs, 19 samples before the last
    assert (plan.num_epochs, plan.samples_before_last_epoch, plan.separate_last_epoch) == (3, 19, True)
    plan = plan_epochs(100, 27, 10)  # 8 of 9 samples from the last epoch: above the 80% threshold
    assert plan.num_epochs == 3 and not plan.separate_last_epoch
    with pytest.raises(ValueError, match="no tokens"):
        plan_epochs(0, 5, 10)


def test_full_build_separate_last_epoch_is_deterministic():
    sizes = np.random.default_rng(1).integers(1, 50, size=100).astype(np.int32)
    docs = np.arange(100)
    a = build_gpt_indices(sizes, docs, num_samples=300, seq_length=32, seed=5)
    b = build_gpt_indices(sizes, docs, num_samples=300, seq_length=32, seed=5)
    c = build_gpt_indices(sizes, docs, num_samples=300, seq_length=32, seed=6)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[2], c[2])
    assert len(a[1]) - 1 >= 300


def reference_gpt_indices(sizes, documents, num_samples, seq_length, seed):
    """Megatron core's _build_document_sample_shuffle_indices, transcribed step by step."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_last < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = reference_document_index(documents, num_epochs, rng, separate)
    sample_idx = reference_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    n = sample_idx.shape[0] - 1
    first = np.arange(before_last if separate else n, dtype=np.uint32)
    rng.shuffle(first)
    if not separate:
        return doc_idx, sample_idx, first
    last = np.arange(before_last, n, dtype=np.uint32)
    rng.shuffle(last)
    return doc_idx, sample_idx, np.concatenate((first, last))


@pytest.mark.parametrize("num_samples", [1, 40, 70, 95, 130, 333])  # 70: 2 epochs, not separated
def test_full_build_matches_reference(num_samples):
    sizes = np.random.default_rng(num_samples).integers(0, 60, size=30).astype(np.int32)
    documents = np.arange(3, 27)  # a split in the middle of the dataset
    got = build_gpt_indices(sizes, documents, num_samples, seq_length=16, seed=1234)
    want = reference_gpt_indices(sizes, documents, num_samples, 16, 1234)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
