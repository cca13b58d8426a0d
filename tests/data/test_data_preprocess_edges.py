"""Preprocessing edges: long documents tokenized in bounded-memory slices (ids equal to the whole),
a clear refusal where a tokenizer cannot be sliced, a truncated .jsonl.gz named with the output
before it kept, and unwritable or full outputs reported in one line."""
import errno
import gzip
import json

import numpy as np
import pytest

from megazoo.data import long_documents
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazoo.data.long_documents import safe_slices
from tests.fixtures import GPT2, SENTENCEPIECE_MODELS
from tests.tool_runs import load_tool, preprocess, read_docs, write_jsonl


@pytest.fixture(scope="module")
def tok():
    from megazoo.data.tokenizers import build_tokenizer
    return build_tokenizer("GPT2BPETokenizer", str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))


def nasty_text(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    pieces = ["word", "Über", "naïve", "'s", "'ll", "123", "4567", "!!", "...", " ", "  ", "\n", "\n\n",
              "\t", " \n ", "<|endoftext|>", "😀", "日本語", "(x)", "a-b", "\r\n", "   \t\n"]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_slices_tokenize_exactly_like_the_whole(tok):
    for seed in range(5):
        text = nasty_text(3000, seed)
        pieces = list(safe_slices(text, 37))
        assert "".join(pieces) == text and len(pieces) > 50
        sliced = [i for p in pieces for i in tok.encode(p)]
        assert sliced == tok.encode(text), seed


def test_a_long_document_is_tokenized_in_slices(tmp_path, tok, monkeypatch):
    long = nasty_text(40000, 9)
    want = tok.encode(long) + [tok.eod]
    monkeypatch.setattr(long_documents, "SLICE_CHARS", 1000)
    calls = []
    real = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, t: calls.append(len(t)) or real(self, t))
    write_jsonl(tmp_path / "c.jsonl", ["short one", long, "another"])
    preprocess("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "o", "--append-eod")
    docs, _ = read_docs(tmp_path / "o_text_document")
    assert docs[1] == want
    assert len(calls) > 20 and max(calls) < 1100  # no call saw more than about a slice


def test_unsliceable_tokenizer_refuses_a_too_long_document(tmp_path):
    sp = next(m for m in SENTENCEPIECE_MODELS if m.name == "botchan_en_bpe_1000.model")
    write_jsonl(tmp_path / "c.jsonl", ["short", "x " * 600, "fine"])
    argv = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(sp), "--no-progress",
            "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"),
            "--max-unsliced-chars", "1000"]
    assert load_tool("preprocess_data").main(argv) == 0
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 2
    skipped = (tmp_path / "o_skipped.txt").read_text()
    assert "c.jsonl:2\tdocument of 1,200 characters is longer than --max-unsliced-chars 1,000" in skipped


def test_truncated_gz_is_named_and_earlier_output_kept(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", ["first file doc", "second"])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"doc {i} " + "lorem ipsum " * 20}) + "\n")
    data = (tmp_path / "b.jsonl.gz").read_bytes()
    (tmp_path / "b.jsonl.gz").write_bytes(data[: len(data) // 2])
    write_jsonl(tmp_path / "c.jsonl", ["never read"])
    for extra in ([], ["--workers", "2", "--partitions", "3"]):
        out = preprocess("--input", tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl",
                         "--output-prefix", tmp_path / "o", *extra, ok=False)
        assert "b.jsonl.gz: truncated or corrupt compressed data after line" in out, out
        assert "input files after it were not read" in out
        docs, ds = read_docs(tmp_path / "o_text_document")
        assert docs[:2] == expected_ids(tok, ["first file doc", "second"])
        assert 2 < ds.num_documents < 3002 and tok.encode("never read") not in docs


def expected_ids(tok, texts):
    return [tok.encode(t) for t in texts]


def test_unwritable_and_full_outputs_are_one_line(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "c.jsonl", ["a document"])
    (tmp_path / "file").write_text("not a folder")
    out = preprocess("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "file" / "o", ok=False)
    assert out.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'file'}") and "Traceback" not in out

    def full(self, tokens, lengths):
        raise OSError(errno.ENOSPC, "No space left on device", self.bin_file)
    monkeypatch.setattr(IndexedDatasetBuilder, "add_documents", full)
    out = preprocess("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "o", ok=False)
    assert f"error: {tmp_path / 'o_text_document.bin'}: No space left on device; nothing written" in out
    assert not list(tmp_path.glob("o_text_document*"))
