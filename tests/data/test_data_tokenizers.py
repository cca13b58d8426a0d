"""Tokenizers over the real files in tests/fixtures, and tools/train_tokenizer.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazoo.data.tokenizers import TokenizerError, build_tokenizer
from tests.fixtures import GPT2, SENTENCEPIECE_MODELS as SP_MODELS

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    "  leading and trailing   spaces   ",
    "tabs\tand\n\nnewlines\r\n  \n\t\t mixed",
    "café naïve Æsir ß ﬁ — “quotes” …",
    "日本語のテキストと中文文本, 한국어",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 and flags 🇯🇵 ",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "it's they'll I'm we've 1234567890 3.14159",
    "literal <|endoftext|> inside text",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]


@pytest.fixture(scope="module")
def hf_gpt2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Tokenizer

    return GPT2Tokenizer.from_pretrained(str(GPT2), local_files_only=True)


def _openai_layout(folder: Path) -> Path:
    """The same tokenizer in OpenAI's original files: encoder.json (spaced JSON), vocab.bpe."""
    vocab = json.loads((GPT2 / "vocab.json").read_text(encoding="utf-8"))
    (folder / "encoder.json").write_text(json.dumps(vocab), encoding="utf-8")
    merges = (GPT2 / "merges.txt").read_text(encoding="utf-8").split("\n", 1)[1]
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + merges, encoding="utf-8")
    return folder


@pytest.mark.parametrize("files", [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")])
def test_gpt2_matches_transformers(hf_gpt2, files, tmp_path):
    folder = GPT2 if files[0] == "vocab.json" else _openai_layout(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", str(folder / files[0]), str(folder / files[1]))
    assert tok.vocab_size == 50257 and tok.eod == 50256
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_gpt2.encode(text), text
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("model", SP_MODELS, ids=lambda p: p.name)
def test_sentencepiece_models_round_trip(model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))
    assert tok.vocab_size in (1000, 8000) and tok.eod == 2
    text = "吾輩は猫である。名前はまだ無い。" if "ja" in model.name else "I am a cat. As yet I have no name."
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, ""]) == [ids, []]


def test_hf_tokenizer_json_and_folder(tmp_path):
    from tokenizers import Tokenizer

    gpt2 = build_tokenizer("GPT2BPETokenizer", str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))
    gpt2._tok.save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path / "tokenizer.json", tmp_path):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
        assert tok.eod == 50256 and tok.vocab_size == 50257
        assert [tok.encode(t) for t in TEXTS] == [gpt2.encode(t) for t in TEXTS]
        assert tok.decode(tok.encode(TEXTS[5])) == TEXTS[5]


def test_hf_folder_without_tokenizer_json(tmp_path):
    import shutil

    for name in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2 / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))  # via AutoTokenizer
    gpt2 = build_tokenizer("GPT2BPETokenizer", str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))
    assert tok.eod == 50256 and tok.vocab_size == 50257
    assert [tok.encode(t) for t in TEXTS[:6]] == [gpt2.encode(t) for t in TEXTS[:6]]


def test_bad_tokenizer_arguments(tmp_path):
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type"):
        build_tokenizer("NoSuchTokenizer")
    with pytest.raises(TokenizerError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", str(GPT2 / "vocab.json"))
    with pytest.raises(TokenizerError, match="missing.model: not found"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "junk.model"))


def test_train_tokenizer_tool(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()
    for i in range(30):
        line = " ".join(words[(i + j) % len(words)] for j in range(40))
        (corpus / f"doc{i}.txt").write_text(f"{line}\n{line.upper()}\n")
    tool = [sys.executable, str(ROOT / "tools" / "train_tokenizer.py"), "--input", str(corpus)]
    subprocess.run(tool + ["--type", "bpe", "--vocab-size", "400", "--output", str(tmp_path / "bpe")],
                   check=True, capture_output=True)
    bpe = build_tokenizer("GPT2BPETokenizer", str(tmp_path / "bpe" / "vocab.json"), str(tmp_path / "bpe" / "merges.txt"))
    assert bpe.decode(bpe.encode("the lazy cat")) == "the lazy cat" and bpe.vocab_size <= 400
    subprocess.run(tool + ["--type", "sentencepiece", "--vocab-size", "60", "--output", str(tmp_path / "sp")],
                   check=True, capture_output=True)
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    assert sp.vocab_size == 60 and sp.decode(sp.encode("the lazy cat")) == "the lazy cat"
