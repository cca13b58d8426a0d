"""Tokenizers from real Hugging Face folders: a folder with only vocab.json + merges.txt
(+ tokenizer_config.json) gives the ids of the same tokenizer's tokenizer.json, for GPT-2's and
Qwen2's byte-level BPE, with the special tokens in either tokenizer_config.json form; a
sentencepiece-only folder works; tools/preprocess_data.py writes identical files from both
folders; a folder with nothing usable is one line naming the folder and the flag."""
import json
import os

import pytest

from megazoo.data.tokenizers import TokenizerError, build_tokenizer
from tests.tokenizer_data import CHAT, TOKENIZER_TEXTS, tokenizer_folders


@pytest.mark.parametrize("kind,old_config", [("gpt2", False), ("gpt2", True), ("qwen2", True)])
def test_vocab_and_merges_folder_gives_the_tokenizer_json_ids(tmp_path, kind, old_config):
    full, mini, hf = tokenizer_folders(tmp_path, kind, old_config)
    a = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=full)
    b = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=mini)
    assert (a.vocab_size, a.eod) == (b.vocab_size, b.eod) == (len(hf), hf.eos_token_id)
    for text in TOKENIZER_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert a.encode(text) == b.encode(text) == ids, text
        assert b.decode(ids) == hf.decode(ids)
    assert b.encode(CHAT[1]) == [hf.convert_tokens_to_ids(CHAT[1])]  # one special token


def test_preprocess_data_gives_the_same_files_from_both_folders(tmp_path):
    from tests.tool_runs import load_tool
    tool = load_tool("preprocess_data")
    full, mini, _ = tokenizer_folders(tmp_path, "gpt2", True)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TOKENIZER_TEXTS))
    outputs = []
    for folder in (full, mini):
        prefix = str(tmp_path / os.path.basename(folder) / "c")
        assert tool.main(["--input", str(corpus), "--output-prefix", prefix, "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", folder, "--append-eod",
                          "--no-progress"]) == 0
        outputs.append(open(prefix + "_text_document.bin", "rb").read())
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0


def test_sentencepiece_folder_and_unusable_folder(tmp_path, capsys):
    import sentencepiece as spm
    folder = tmp_path / "sp"
    folder.mkdir()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test"] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=40, model_type="bpe")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))
    ref = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert tok.encode("hello lazy fox") == ref.encode("hello lazy fox") and tok.eod == ref.eos_id()

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(TokenizerError) as e:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(empty))
    message = str(e.value)
    assert "\n" not in message and str(empty) in message and "--tokenizer-model" in message
