"""megazoo's GPT datasets against megatron-core's own, sample for sample.

megatron-core (installed, with its compiled C++ helpers) builds the datasets as Megatron's GPT
training does: `BlendedMegatronDatasetBuilder(GPTDataset, sizes, ..., GPTDatasetConfig(...))` with
a stub tokenizer carrying the end-of-document and pad ids. megazoo builds them from the same
flags (`data.blended.build_train_valid_test_datasets`) and turns samples into batches as its
training does (`training.run.batches.microbatches`). Compared: every index array, and per sample
the tokens, labels, loss mask, attention mask and position ids, on .bin/.idx files written by
megazoo's preprocessing and by megatron-core's `IndexedDatasetBuilder`.

One process; BlendedDataset asks torch.distributed for the rank when it writes its cache, so the
module runs in a one-rank gloo group.
"""
import contextlib
import json
import os
import socket
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megazoo.data.blended import build_train_valid_test_datasets, parse_data_path
from megazoo.data.gpt_dataset import GPTDatasetConfig, build_split_datasets
from megazoo.data.gpt_indices import build_document_index, build_sample_index, plan_epochs
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazoo.data.per_split import build_per_split_datasets
from tests.fixtures import small_gpt2
from tests.tool_runs import preprocess

SEQ = 32
EOD = 300  # small_gpt2's <|endoftext|>
# Sizes as Megatron-LM's training computes them (megatron/training/training.py
# get_train_valid_test_num_samples, read at Megatron-LM d98e8a64; not installed here):
# train_iters * gbs, (train_iters // eval_interval + 1) * eval_iters * gbs, eval_iters * gbs.
TRAIN_ITERS, GBS, EVAL_INTERVAL, EVAL_ITERS = 8, 4, 4, 2
SIZES = (TRAIN_ITERS * GBS, (TRAIN_ITERS // EVAL_INTERVAL + 1) * EVAL_ITERS * GBS, EVAL_ITERS * GBS)


class TokenizerStub:
    """What megatron-core's GPTDatasetConfig and GPTDataset read from a tokenizer."""

    def __init__(self, vocab_size: int, eod: int, pad: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, pad

    @property
    def unique_identifiers(self):
        return OrderedDict({"class": "TokenizerStub", "eod": self.eod, "pad": self.pad})


@contextlib.contextmanager
def one_rank_world():
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def documents(rng, n, short, long_every, long):
    """Token lengths: mostly shorter than SEQ, every `long_every`-th longer than it."""
    return [int(rng.integers(*long)) if i % long_every == 0 else int(rng.integers(*short)) for i in range(n)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    from megatron.core.datasets import indexed_dataset as mc_indexed
    root = tmp_path_factory.mktemp("mcore")
    rng = np.random.default_rng(0)
    vocab, merges = small_gpt2(root / "tok")
    letters = np.array(list("abcdefghij "))
    texts = ["".join(rng.choice(letters, size=n)) for n in documents(rng, 520, (2, 24), 20, (80, 200))]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess("--input", root / "a.jsonl", "--output-prefix", root / "a", "--append-eod",
               "--vocab-file", vocab, "--merge-file", merges)
    a = str(root / "a_text_document")
    # The same documents written by megatron-core's builder: the same bytes.
    ours = IndexedDataset(a)
    builder = mc_indexed.IndexedDatasetBuilder(a + "_mc.bin", dtype=np.uint16)
    for i in range(len(ours)):
        builder.add_document(np.asarray(ours[i]), [len(ours[i])])
    builder.finalize(a + "_mc.idx")
    # b: megatron-core's writer, int32, empty documents, one document of two sequences.
    b = str(root / "b")
    builder = mc_indexed.IndexedDatasetBuilder(b + ".bin", dtype=np.int32)
    for i, n in enumerate(documents(rng, 600, (0, 12), 15, (40, 90))):
        n = max(n, 5) if i == 7 else n
        doc = np.append(rng.integers(0, EOD, size=n), EOD) if n else np.zeros(0, np.int64)
        if i == 7:
            builder.add_item(torch.from_numpy(doc[:3]))
            builder.add_item(torch.from_numpy(doc[3:]))
            builder.end_document()
        else:
            builder.add_document(doc, [len(doc)])
    builder.finalize(b + ".idx")
    # c: megazoo's writer.
    c = str(root / "c")
    builder = IndexedDatasetBuilder(c + ".bin", dtype=np.uint16)
    for n in documents(rng, 560, (1, 10), 10, (33, 70)):
        builder.add_document(np.append(rng.integers(0, EOD, size=n), EOD))
    builder.finalize(c + ".idx")
    with one_rank_world():
        yield dict(a=a, a_mc=a + "_mc", b=b, c=c, root=root)


def test_files_written_by_either_program_read_the_same(corpora):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as McIndexed
    a, a_mc = corpora["a"], corpora["a_mc"]
    for suffix in (".bin", ".idx"):
        assert open(a + suffix, "rb").read() == open(a_mc + suffix, "rb").read()
    for prefix in (a, corpora["b"], corpora["c"]):
        ours, theirs = IndexedDataset(prefix), McIndexed(prefix)
        assert ours.dtype == theirs.index.dtype and len(ours) == len(theirs)
        np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
        np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
        for i in range(len(ours)):
            np.testing.assert_array_equal(ours[i], theirs[i])
        np.testing.assert_array_equal(ours.get(1, 1, 2), theirs.get(1, 1, 2))


# ---- building both ----------------------------------------------------------------------------


def megatron_build(data_path, split, sizes, seed, cache, *, reset_position_ids=False,
                   reset_attention_mask=False, eod_mask_loss=False, add_extra_token=True,
                   per_split=None, pad=-1, **validation):
    """megatron-core's datasets; `per_split`: three blends (or None) as blend_per_split, as
    Megatron-LM's get_blend_and_blend_per_split makes them of --train/valid/test-data-path."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQ, blend=get_blend_from_list(data_path), split=split,
        blend_per_split=None if per_split is None else [get_blend_from_list(b) for b in per_split],
        path_to_cache=cache, tokenizer=TokenizerStub(EOD + 1, EOD, pad),
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=True,
        add_extra_token_to_sequence=add_extra_token, **validation)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def megazoo_build(data_path, split, sizes, seed, cache):
    return build_train_valid_test_datasets(data_path, split, SEQ, seed, sizes, cache)


def assert_same_indices(ours, theirs, where):
    assert (ours is None) == (theirs is None), f"{where}: built {ours is not None} vs {theirs is not None}"
    if ours is None:
        return
    assert len(ours) == len(theirs), f"{where}: {len(ours)} samples vs megatron-core's {len(theirs)}"
    names = ("dataset_index", "dataset_sample_index") if hasattr(theirs, "datasets") else \
        ("document_index", "sample_index", "shuffle_index")
    for name in names:
        got, want = np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
        assert got.dtype == want.dtype, f"{where} {name}: {got.dtype} vs {want.dtype}"
        np.testing.assert_array_equal(got, want, err_msg=f"{where} {name}")
    for i, (o, t) in enumerate(zip(getattr(ours, "datasets", []), getattr(theirs, "datasets", []))):
        assert_same_indices(o, t, f"{where} component {i}")


def megazoo_batch(ds, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, pad=None):
    """All of `ds` as one batch, the way megazoo's training reads it: Megatron's fields."""
    from megazoo.training.run.batches import DocumentFlags, microbatches
    flags = DocumentFlags(EOD, reset_position_ids, reset_attention_mask) \
        if reset_position_ids or reset_attention_mask else None
    stream = microbatches(ds, consumed_samples=0, micro_batch_size=len(ds), dp_rank=0, dp=1,
                          device=torch.device("cpu"), eod_mask_token=EOD if eod_mask_loss else None,
                          documents=flags, pad_mask_token=pad)
    mb = next(stream)
    stream.close()
    b, s = mb["tokens"].shape
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    visible = causal.expand(b, s, s)
    if "document_ids" in mb:
        docs = mb["document_ids"]
        visible = visible & (docs[:, :, None] == docs[:, None, :])
    return {"tokens": mb["tokens"], "labels": mb["labels"],
            "loss_mask": mb.get("loss_mask", torch.ones(b, s)),
            "position_ids": mb.get("position_ids", torch.arange(s).expand(b, s)),
            "attention_mask": ~visible[:, None]}


def megatron_batch(ds):
    items = [ds[i] for i in range(len(ds))]
    return {k: torch.stack([torch.as_tensor(item[k]) for item in items]) for k in items[0]}


def assert_same_samples(ours, theirs, where, **flags):
    got, want = megazoo_batch(ours, **flags), megatron_batch(theirs)
    for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
        assert got[key].shape == want[key].shape, f"{where} {key}: {got[key].shape} vs {want[key].shape}"
        mismatched = (got[key] != want[key]).flatten(1).any(1).nonzero().flatten().tolist()
        assert not mismatched, f"{where} {key}: samples {mismatched[:10]} differ from megatron-core's"
    if "dataset_id" in want:
        assert [ours[i]["dataset_id"] for i in range(len(ours))] == want["dataset_id"].tolist(), where


def compare(data_path, split, sizes, seed, cache, samples=True):
    ours = megazoo_build(data_path, split, sizes, seed, os.path.join(cache, "megazoo"))
    theirs = megatron_build(data_path, split, sizes, seed, os.path.join(cache, "megatron"))
    for name, o, t in zip(("train", "valid", "test"), ours, theirs):
        where = f"--data-path {' '.join(map(str, data_path))} --split {split} {name}"
        assert_same_indices(o, t, where)
        if samples and o is not None:
            assert_same_samples(o, t, where)
    return ours, theirs


# ---- the cases ---------------------------------------------------------------------------------


def test_sizes_as_megatron_training_asks_for_them():
    from megazoo.training.run.batches import dataset_num_samples
    assert dataset_num_samples(TRAIN_ITERS, None, GBS, EVAL_INTERVAL, EVAL_ITERS) == (*SIZES[:2], 0)
    # --train-samples 30, gbs 4: Megatron asks 30 samples and trains 30 // 4 = 7 iterations
    assert dataset_num_samples(7, 30, 4, 4, 2) == (30, (7 // 4 + 1) * 2 * 4, 0)


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1,0,0"])
def test_one_prefix_splits(corpora, split):
    ours, _ = compare([corpora["a"]], split, SIZES, 1234, str(corpora["root"] / "cache_a"))
    assert ours[0] is not None


def test_epochs_separate_or_not_and_documents_longer_than_a_sample(corpora):
    prefix, cache = corpora["b"], str(corpora["root"] / "cache_epochs")
    tokens = int(IndexedDataset(prefix).sequence_lengths.sum())
    per_epoch = (tokens - 1) // SEQ
    # the last of three epochs gives 10% of an epoch's samples (separated) or 90% (not)
    for fraction in (0.1, 0.9):
        n = 2 * per_epoch + int(fraction * per_epoch)
        plan = plan_epochs(tokens, n, SEQ)
        assert plan.num_epochs == 3 and plan.separate_last_epoch == (fraction < 0.8)
        compare([prefix], "1", (n, 0, 0), 5, cache)
    # samples of SEQ tokens without the extra label token (add_extra_token_to_sequence False)
    n = 2 * per_epoch + per_epoch // 2
    config = GPTDatasetConfig(SEQ, 5, os.path.join(cache, "megazoo"), add_extra_token=0)
    ours = build_split_datasets(prefix, "1", (n, 0, 0), config)
    theirs = megatron_build([prefix], "1", (n, 0, 0), 5, os.path.join(cache, "megatron"),
                            add_extra_token=False)
    assert_same_indices(ours[0], theirs[0], "add_extra_token_to_sequence=False")
    assert all(np.array_equal(ours[0][i]["tokens"], theirs[0][i]["tokens"]) for i in range(len(ours[0])))


def test_sample_index_against_the_cpp_helper():
    """The searchsorted sample index against helpers.cpp's loop on random cases: empty documents,
    documents longer than a sample, add_extra_token 0, and a kept partial last sample."""
    from megatron.core.datasets import helpers
    for case in range(60):
        rng = np.random.default_rng(case)
        n_docs = int(rng.integers(1, 40))
        sizes = rng.integers(0, 30, size=n_docs).astype(np.int32)  # includes empty documents
        sizes[rng.integers(0, n_docs)] += 1  # at least one token
        seq_length, num_epochs, tokens = int(rng.integers(1, 50)), int(rng.integers(1, 4)), int(sizes.sum())
        add_extra, drop_last = int(case % 3 != 0), case % 5 != 0
        if num_epochs * tokens - add_extra < seq_length and drop_last:
            num_epochs = seq_length // tokens + 2
        doc_idx = build_document_index(np.arange(n_docs), num_epochs, np.random.RandomState(case), False)
        got = build_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens, drop_last, add_extra)
        want = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens, drop_last,
                                        bool(add_extra))
        assert got.dtype == want.dtype, case
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}")


def test_weighted_and_unweighted_blends(corpora):
    a, b, c, cache = corpora["a"], corpora["b"], corpora["c"], str(corpora["root"] / "cache_blend")
    compare(["0.3", a, "0.7", b], "969,30,1", SIZES, 1234, cache)
    compare(["2", a, "1", b, "1", c], "98,2,0", SIZES, 3, cache)
    compare([b, c], "98,2,0", SIZES, 1234, cache)  # without weights: by sample counts
    compare(["1", a], "969,30,1", SIZES, 1234, cache)  # one weighted prefix: still a blend


@pytest.mark.parametrize("flags", [
    dict(reset_position_ids=True), dict(reset_attention_mask=True), dict(eod_mask_loss=True),
    dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)])
def test_document_flags(corpora, flags):
    prefix, cache = corpora["b"], str(corpora["root"] / "cache_flags")
    ours = megazoo_build([prefix], "969,30,1", SIZES, 1234, os.path.join(cache, "megazoo"))[0]
    theirs = megatron_build([prefix], "969,30,1", SIZES, 1234, os.path.join(cache, "megatron"), **flags)[0]
    assert_same_samples(ours, theirs, f"train {flags}", **flags)


def test_seeds_and_cache_reuse(corpora, monkeypatch):
    from megatron.core.datasets import helpers
    a, b, cache = corpora["a"], corpora["c"], str(corpora["root"] / "cache_seeds")
    first = {seed: compare(["0.4", a, "0.6", b], "969,30,1", SIZES, seed, cache, samples=False)
             for seed in (1, 2)}
    train = {seed: first[seed][0][0] for seed in (1, 2)}  # megazoo's training blends
    assert not np.array_equal(train[1].datasets[0].shuffle_index, train[2].datasets[0].shuffle_index)

    def refuse(*args):
        raise AssertionError("megatron-core rebuilt indices that its cache holds")
    monkeypatch.setattr(helpers, "build_sample_idx", refuse)
    monkeypatch.setattr(helpers, "build_blending_indices", refuse)
    for seed in (1, 2):
        ours, _ = compare(["0.4", a, "0.6", b], "969,30,1", SIZES, seed, cache, samples=seed == 1)
        assert not any(d.built_anew for d in ours[0].datasets) and not ours[0].cache.built_anew
        assert_same_indices(ours[0], first[seed][1][0], f"seed {seed}: cached against built")


def test_per_split_blends(corpora):
    """--train/valid/test-data-path against megatron-core's blend_per_split: a weighted blend, an
    unweighted one, a single prefix (also with a weight: the plain dataset), a split without a path."""
    a, b, c, cache = corpora["a"], corpora["b"], corpora["c"], str(corpora["root"] / "cache_per_split")
    cases = [(["0.3", a, "0.7", b], [c], None),  # test: no path, no dataset
             ([b, c], ["1", a], ["2", c, "1", b]),
             (["1", b], ["0.5", a, "0.5", c], [a])]
    for seed, blends in enumerate(cases):
        ours = build_per_split_datasets(blends, SEQ, 7 + seed, SIZES, os.path.join(cache, "megazoo"),
                                        vocab_size=EOD + 1)
        theirs = megatron_build(None, None, SIZES, 7 + seed, os.path.join(cache, "megatron"), per_split=blends)
        for name, o, t, blend in zip(("train", "valid", "test"), ours, theirs, blends):
            where = f"--{name}-data-path {blend}"
            assert_same_indices(o, t, where)
            if o is not None:
                assert_same_samples(o, t, where)
        assert ours[2] is None if blends[2] is None else ours[2] is not None
        # a weighted single prefix is the plain dataset, not a blend of one
        single = [o for o, bl in zip(ours, blends) if bl and len(parse_data_path(bl).prefixes) == 1]
        assert single and not any(hasattr(o, "datasets") for o in single)


def test_whole_validation_sets(corpora):
    """--full-validation's validation size None (one epoch of the split; several unweighted
    prefixes blended exhaustively) and --multiple-validation-sets' one dataset per
    --valid-data-path prefix, against megatron-core's builder with those config fields."""
    a, b, c, cache = corpora["a"], corpora["b"], corpora["c"], str(corpora["root"] / "cache_full")
    sizes = (SIZES[0], None, SIZES[2])
    full = dict(full_validation=True)
    for data_path in ([a], [b, c]):
        ours = megazoo_build(data_path, "90,10,0", sizes, 3, os.path.join(cache, "megazoo"))[1]
        theirs = megatron_build(data_path, "90,10,0", sizes, 3, os.path.join(cache, "megatron"), **full)[1]
        assert_same_indices(ours, theirs, f"--data-path {data_path} valid, whole")
        assert_same_samples(ours, theirs, f"--data-path {data_path} valid, whole")
    blends = ([a], [b, c], None)
    ours = build_per_split_datasets(blends, SEQ, 4, sizes, os.path.join(cache, "megazoo"),
                                    multiple_validation_sets=True)[1]
    theirs = megatron_build(None, None, sizes, 4, os.path.join(cache, "megatron"), per_split=blends,
                            multiple_validation_sets=True, **full)[1]
    assert isinstance(theirs, list) and len(ours) == len(theirs) == 2
    for k, (o, t) in enumerate(zip(ours, theirs)):
        assert_same_indices(o, t, f"validation set {k}")
        assert_same_samples(o, t, f"validation set {k}")


def test_pad_id_loss_mask(corpora, tmp_path):
    """A tokenizer pad id distinct from the end-of-document: megatron-core masks the loss where the
    label is it and maps it to 0 in tokens and labels; so does megazoo's batch (with the document
    flags, found before the mapping). The pad id comes from the tokenizer as megatron-core takes it."""
    from megazoo.data.tokenizers import build_tokenizer, loss_pad_id
    prefix, cache, pad = corpora["b"], str(corpora["root"] / "cache_pad"), 7  # id 7 occurs in b
    flags = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    ours = megazoo_build([prefix], "969,30,1", SIZES, 1234, os.path.join(cache, "megazoo"))[0]
    theirs = megatron_build([prefix], "969,30,1", SIZES, 1234, os.path.join(cache, "megatron"), pad=pad,
                            **flags)[0]
    masked = (megatron_batch(theirs)["loss_mask"] == 0).sum()
    assert masked > (megazoo_batch(ours, **flags)["loss_mask"] == 0).sum()  # the pad id occurs
    assert_same_samples(ours, theirs, "pad 7", pad=pad, **flags)
    # pad == eod: megatron-core masks nothing more (its pad falls back to -1)
    same = megatron_build([prefix], "969,30,1", SIZES, 1234, os.path.join(cache, "megatron"), pad=EOD)[0]
    assert_same_samples(ours, same, "pad = eod")
    vocab, merges = small_gpt2(tmp_path / "hf")
    assert loss_pad_id(build_tokenizer("GPT2BPETokenizer", vocab, merges)) is None
    for pad_token, want in (("<|endoftext|>", None), ("!", 0), ("a", 64), (None, None)):
        (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad_token}))
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
        assert loss_pad_id(tok) == want, pad_token
    # a pad that is also another special token (Llama-2-derived folders: pad = unk or bos): none
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": "!", "unk_token": "!", "bos_token": "a"}))
    assert loss_pad_id(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))) is None
