"""Datasets are checked against the model's vocabulary before step 1: the id range recorded by the
preprocessor (or scanned once and cached for older files) and the .idx dtype."""
import json
import os

import numpy as np
import pytest

from megazoo.data import token_stats
from megazoo.data.indexed import IndexedDatasetBuilder, bin_path, idx_path
from megazoo.data.token_stats import VocabularyMismatch, check_vocabulary, stats_path


def build(prefix: str, ids, dtype, tokenizer=None, sidecar=True) -> str:
    b = IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for start in range(0, len(ids), 50):
        b.add_document(np.asarray(ids[start:start + 50]))
    b.finalize(idx_path(prefix))
    if sidecar:
        token_stats.write_stats(prefix, dtype, b.min_id, b.max_id, tokenizer)
    return prefix


QWEN = dict(type="HuggingFaceTokenizer", vocab_size=151643, tokenizer_model="Qwen/tokenizer.json")


def test_foreign_vocabulary_is_refused_with_both_numbers_and_the_tokenizer(tmp_path):
    ids = list(range(0, 151000, 97))
    prefix = build(str(tmp_path / "qwen"), ids, np.int32, QWEN)
    check_vocabulary([prefix], 151643)
    with pytest.raises(VocabularyMismatch, match=r"qwen: token ids span \[0, 150932\], the model's "
                                                 r"vocabulary has 50257 entries .* made with "
                                                 r"--tokenizer-type HuggingFaceTokenizer "
                                                 r"--tokenizer-model Qwen/tokenizer.json \(vocabulary 151643\)"):
        check_vocabulary([prefix], 50257)


def test_older_files_are_scanned_once_and_cached(tmp_path, monkeypatch):
    prefix = build(str(tmp_path / "old"), [5, 70, 3, 9] * 40, np.uint16, sidecar=False)
    monkeypatch.setattr(token_stats, "SCAN_CHUNK", 7)  # many chunks: the bounded scan is exercised
    with pytest.raises(VocabularyMismatch, match=r"token ids span \[3, 70\], the model's vocabulary "
                                                 r"has 61 entries .* unrecorded tokenizer"):
        check_vocabulary([prefix], 61)
    assert json.load(open(stats_path(prefix)))["max_token_id"] == 70
    monkeypatch.setattr(token_stats, "scan", lambda ds: pytest.fail("scanned again"))
    check_vocabulary([prefix], 71)


def test_relabelled_idx_dtype_is_refused(tmp_path):
    prefix = build(str(tmp_path / "u16"), [40000, 1, 2, 3] * 40, np.uint16,
                   dict(type="GPT2BPETokenizer", vocab_size=50257))
    check_vocabulary([prefix], 50257)
    with open(idx_path(prefix), "r+b") as f:  # uint16 (code 8) relabelled int16 (code 3)
        f.seek(17)
        f.write(bytes([3]))
    with pytest.raises(VocabularyMismatch, match=r"u16.idx: tokens stored as int16 cannot hold the "
                                                 r"ids of this model's 50257-token vocabulary"):
        check_vocabulary([prefix], 50257)
    with pytest.raises(VocabularyMismatch, match=r"token ids span \[-25536, 3\]"):
        check_vocabulary([prefix], 1000)  # int16 holds 1000 ids, but the relabelled ids went negative


def test_training_refuses_before_step_1(tmp_path):
    from tests.helpers import TINY, pretrain_gpt
    rng = np.random.default_rng(0)
    prefix = build(str(tmp_path / "big"), rng.integers(0, 100, 4000).tolist(), np.uint16,
                   dict(type="GPT2BPETokenizer", vocab_size=100, vocab_file="v.json", merge_file="m.txt"))
    argv = [a for a in TINY if a != "--mock-data"] + ["--data-path", prefix, "--train-iters", "2",
                                                       "--split", "100,0,0"]
    with pytest.raises(VocabularyMismatch, match=r"ids 0..60\); the data was made with --tokenizer-type "
                                                 r"GPT2BPETokenizer --vocab-file v.json --merge-file m.txt"):
        pretrain_gpt(argv, 1)
    assert not os.path.exists(str(tmp_path / "cache"))  # refused before any index was built
