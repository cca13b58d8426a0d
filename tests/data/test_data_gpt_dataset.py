"""GPTDataset, splits, blending, caching across ranks, and the DP sampler."""
import os

import numpy as np
import pytest

from megazoo.data.blended import build_blending_indices, build_train_valid_test_datasets, parse_data_path
from megazoo.data.gpt_dataset import GPTDataset, GPTDatasetConfig, parse_split, split_boundaries
from megazoo.data.gpt_indices import plan_epochs
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazoo.data.samplers import PretrainingSampler
from tests.distributed import run_distributed


def make_corpus(prefix, n_docs=50, seed=0, offset=0):
    """Documents whose tokens are globally unique and increasing, so positions are recoverable."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    next_tok = offset
    for n in rng.integers(0, 40, size=n_docs):  # includes empty documents
        b.add_document(np.arange(next_tok, next_tok + n))
        next_tok += int(n)
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def stream_of(ds):
    """The document-index token stream the samples should be cut from."""
    return np.concatenate([ds.indexed.get(int(d)) for d in ds.document_index]).astype(np.int64)


def test_samples_are_consecutive_and_cover_an_epoch(tmp_path):
    prefix = make_corpus(tmp_path / "c")
    indexed = IndexedDataset(prefix)
    docs = np.arange(len(indexed))
    cfg = GPTDatasetConfig(seq_length=16, seed=3, cache_dir=str(tmp_path / "cache"))
    ds = GPTDataset(indexed, prefix, docs, None, cfg)  # None: exactly one epoch
    stream = stream_of(ds)
    position = {int(t): i for i, t in enumerate(stream)}  # tokens are unique within one epoch
    n = len(ds)
    assert n == (int(indexed.sequence_lengths.sum()) - 1) // 16
    starts = []
    for i in range(n):
        tokens = ds[i]["tokens"]
        assert tokens.dtype == np.int64 and len(tokens) == 17
        start = position[int(tokens[0])]
        np.testing.assert_array_equal(tokens, stream[start : start + 17])
        starts.append(start)
    assert sorted(starts) == list(range(0, 16 * n, 16))  # the shuffle is a permutation of all samples
    covered = np.zeros(len(stream), bool)
    for s in starts:
        covered[s : s + 17] = True
    assert covered[: 16 * n + 1].all() and len(stream) - (16 * n + 1) < 16  # only a short tail is unused


def test_multi_epoch_and_cache_reuse(tmp_path):
    prefix = make_corpus(tmp_path / "c", n_docs=10)
    indexed = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(seq_length=8, seed=1, cache_dir=str(tmp_path / "cache"))
    first = GPTDataset(indexed, prefix, np.arange(10), 100, cfg)
    assert first.built_anew and len(first) >= 100
    stream = stream_of(first)
    for i in range(len(first)):
        t = first[i]["tokens"]
        row, off = first.sample_index[first.shuffle_index[i]]
        start = int(sum(indexed.sequence_lengths[first.document_index[:row]])) + int(off)
        np.testing.assert_array_equal(t, stream[start : start + 9])
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and any(f.endswith("sample_index.npy") for f in files)
    mtimes = [os.path.getmtime(tmp_path / "cache" / f) for f in files]
    second = GPTDataset(indexed, prefix, np.arange(10), 100, cfg)
    assert not second.built_anew
    assert [os.path.getmtime(tmp_path / "cache" / f) for f in files] == mtimes
    assert isinstance(second.sample_index, np.memmap)
    np.testing.assert_array_equal(second.shuffle_index, first.shuffle_index)
    other_seed = GPTDataset(indexed, prefix, np.arange(10), 100, GPTDatasetConfig(8, seed=2, cache_dir=cfg.cache_dir))
    assert other_seed.built_anew


def _ranks_build(rank, prefix, cache_dir):
    out = build_train_valid_test_datasets([prefix], "8,2,0", 8, 42, (40, 5, 0), cache_dir)
    train, valid, test = out
    return ([train[i]["tokens"].tolist() for i in range(len(train))], len(valid), test is None, train.built_anew)


def test_rank0_builds_every_rank_reads_same_order(tmp_path):
    prefix = make_corpus(tmp_path / "c", n_docs=30)
    results = run_distributed(_ranks_build, 2, prefix, str(tmp_path / "cache"), timeout=120)
    assert results[0][0] == results[1][0]  # same seed, same order, in every process
    assert results[0][1] >= 5 and results[0][2]
    assert results[0][3] is True and results[1][3] is False  # only rank 0 built the indices


def test_split_parsing():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_boundaries(parse_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    assert split_boundaries(parse_split("1,1,1"), 10) == [0, 3, 7, 10]  # round(1/3 * 10), round(2/3 * 10)
    with pytest.raises(ValueError):
        parse_split("a,b")


def test_epoch_plan():
    # 100 tokens per epoch, seq 10: 9 samples per epoch ((100-1)//10).
    assert plan_epochs(100, 5, 10).num_epochs == 1
    plan = plan_epochs(100, 21, 10)  # needs 211 tokens -> 3 epochs, 19 samples before the last
    assert (plan.num_epochs, plan.samples_before_last_epoch, plan.separate_last_epoch) == (3, 19, True)
    plan = plan_epochs(100, 27, 10)  # 8 of 9 samples from the last epoch: above the 80% threshold
    assert plan.num_epochs == 3 and not plan.separate_last_epoch
    with pytest.raises(ValueError, match="no tokens"):
        plan_epochs(0, 5, 10)


def test_empty_split_is_a_clear_error(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16)
    b.add_document([])
    b.finalize(str(tmp_path / "e.idx"))
    with pytest.raises(ValueError, match="no tokens"):
        build_train_valid_test_datasets([str(tmp_path / "e")], "1", 8, 1, (4, 0, 0), str(tmp_path / "cache"))


def test_blending(tmp_path):
    a = make_corpus(tmp_path / "a", seed=1)
    b = make_corpus(tmp_path / "b", seed=2, offset=10**6)  # token ids tell the source apart
    blend = parse_data_path(f"0.3 {a} 0.7 {b}")
    assert blend.prefixes == [a, b] and blend.weights == pytest.approx([0.3, 0.7])
    train, valid, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "9,1,0", 8, 5, (200, 20, 0), str(tmp_path / "cache"))
    assert len(train) == 200 and len(valid) == 20
    from_b = sum(int(train[i]["tokens"][0] >= 10**6) for i in range(200))
    assert from_b == 140
    ids = [train[i]["dataset_id"] for i in range(200)]
    assert ids[:10] == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    di, si = build_blending_indices([0.5, 0.5], 6)
    assert di.tolist() == [0, 1, 0, 1, 0, 1] and si.tolist() == [0, 0, 1, 1, 2, 2]


def test_sampler_semantics_and_resume():
    full = [list(PretrainingSampler(20, 0, 2, r, 2)) for r in range(2)]
    assert full[0][:2] == [[0, 1], [4, 5]] and full[1][:2] == [[2, 3], [6, 7]]
    assert len(full[0]) == 5
    resumed = list(PretrainingSampler(20, 8, 2, 1, 2))
    assert resumed == full[1][2:]
    assert list(PretrainingSampler(10, 0, 3, 0, 2)) == [[0, 1, 2]]  # partial global batch dropped
    assert list(PretrainingSampler(10, 6, 3, 0, 2, drop_last=False)) == [[6, 7, 8]]
    with pytest.raises(ValueError):
        PretrainingSampler(10, 10, 1, 0, 1)
