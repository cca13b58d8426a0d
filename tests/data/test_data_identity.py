"""Nothing silent about which tokenizer and which tokens a dataset holds.

- A vocab.json + merges.txt folder whose tokenizer_config.json names a class that keeps its
  pre-tokenizer in tokenizer.json only (SmolLM2's PreTrainedTokenizerFast) is refused in one line,
  as transformers refuses it; the GPT-2-like and Qwen2 classes still build (their ids are checked
  against transformers in tests/data/test_tokenizer_folders.py).
- The tokenizer fingerprint is the same for one tokenizer built from tokenizer.json or from
  vocab.json + merges.txt, and differs for a vocabulary of the same size with two ids swapped.
- A dataset re-tokenized to the same byte sizes gets a new content fingerprint: its stats are
  rescanned (with a warning) and its cached sample indices rebuilt.
- tools/preprocess_data.py keeps a record with a lone surrogate out (one line, the rest written),
  reads the first record after a UTF-8 byte-order mark, and records the tokenizer fingerprint.
"""
import importlib.util
import json
import logging
import os
import sys

import numpy as np
import pytest

from megazoo.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder, dataset_fingerprint
from megazoo.data.token_stats import read_stats, token_stats
from megazoo.data.tokenizers import TokenizerError, build_tokenizer
from tests.fixtures import small_gpt2

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SMALL = 300  # small_gpt2's <|endoftext|> id (its vocabulary holds SMALL + 1 tokens)


def _vocab_merges_folder(tmp_path, name, tokenizer_class, swap=None):
    folder = str(tmp_path / name)
    small_gpt2(folder, swap)
    config = {"eos_token": "<|endoftext|>"}
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def test_folder_whose_pre_tokenizer_lives_in_tokenizer_json_is_refused(tmp_path):
    smol = _vocab_merges_folder(tmp_path, "smol", "PreTrainedTokenizerFast")
    with pytest.raises(TokenizerError) as e:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=smol)
    msg = str(e.value)
    assert "tokenizer_config.json" in msg and "PreTrainedTokenizerFast" in msg and "tokenizer.json" in msg
    assert "\n" not in msg
    for cls in ("GPT2TokenizerFast", "RobertaTokenizer", "Qwen2Tokenizer", None):
        tok = build_tokenizer("HuggingFaceTokenizer",
                              tokenizer_model=_vocab_merges_folder(tmp_path, f"ok{cls}", cls))
        assert tok.vocab_size == SMALL + 1


def test_fingerprint_names_the_tokenizer_not_its_file_layout(tmp_path):
    vocab, merges = small_gpt2(str(tmp_path / "small"))
    a = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert a.encode(" the") != [220, 83, 71, 68]  # its merges apply
    full = tmp_path / "full"
    full.mkdir()
    a._tok.save(str(full / "tokenizer.json"))  # the same tokenizer as one tokenizer.json
    b = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(full))
    assert a.fingerprint() == b.fingerprint()
    swapped = build_tokenizer("HuggingFaceTokenizer",
                              tokenizer_model=_vocab_merges_folder(tmp_path, "swapped", None, ("a", "b")))
    assert swapped.vocab_size == a.vocab_size and swapped.fingerprint() != a.fingerprint()
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert null.fingerprint() != build_tokenizer("NullTokenizer", vocab_size=11).fingerprint()


def _write_dataset(prefix, docs):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.int32))
    builder.finalize(prefix + ".idx")


def test_same_size_retokenization_is_rescanned_and_reindexed(tmp_path, caplog):
    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in rng.integers(5, 40, size=30)]
    _write_dataset(prefix, docs)
    first = token_stats(prefix)
    before = dataset_fingerprint(prefix)
    cfg = GPTDatasetConfig(seq_length=8, seed=1, cache_dir=str(tmp_path / "cache"))
    ds = IndexedDataset(prefix)
    old = GPTDataset(ds, prefix, np.arange(30), 20, cfg)
    assert old.built_anew
    # the same documents' lengths and byte sizes, other ids (another vocabulary)
    _write_dataset(prefix, [d + 2000 for d in docs])
    assert dataset_fingerprint(prefix) != before
    with caplog.at_level(logging.WARNING, logger="megazoo.data.token_stats"):
        second = token_stats(prefix)
    assert (second["min_token_id"], second["max_token_id"]) == \
        (first["min_token_id"] + 2000, first["max_token_id"] + 2000)
    assert any("changed since" in r.getMessage() for r in caplog.records)
    new = GPTDataset(IndexedDataset(prefix), prefix, np.arange(30), 20, cfg)
    assert new.built_anew  # the cached indices of the old tokens are not reused
    assert read_stats(prefix)["fingerprint"] == dataset_fingerprint(prefix)


def _preprocess():
    """tools/preprocess_data.py, registered as a module (its dataclasses need that)."""
    name = "tool_preprocess_data"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", "preprocess_data.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_preprocess_bom_and_lone_surrogate(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"text": "first doc"}\n{"text": "bad \\ud800 here"}\n{"text": "third 123"}\n')
    out = str(tmp_path / "out")
    vocab, merges = small_gpt2(str(tmp_path / "small"))
    rc = _preprocess().main(["--input", str(src), "--output-prefix", out, "--tokenizer-type",
                             "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                             "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "in.jsonl:2: key 'text' holds a lone surrogate" in printed
    prefix = out + "_text_document"
    ds = IndexedDataset(prefix)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert [tok.decode(ds.get(i)) for i in range(len(ds))] == ["first doc", "third 123"]
    assert read_stats(prefix)["tokenizer"]["fingerprint"] == tok.fingerprint()
