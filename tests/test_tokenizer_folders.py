"""Tokenizers from real Hugging Face folders: a folder with only vocab.json + merges.txt
(+ tokenizer_config.json) gives the ids of the same tokenizer's tokenizer.json, for GPT-2's and
Qwen2's byte-level BPE, with the special tokens in either tokenizer_config.json form; a
sentencepiece-only folder works; tools/preprocess_data.py writes identical files from both
folders; a folder with nothing usable is one line naming the folder and the flag."""
import json
import os
import shutil

import pytest

from data.tokenizers import TokenizerError, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world! <|endoftext|> naïve café 123 4567\n\n  spaces\tand tabs",
         "I'm here, don't you ALL'S", "日本語のテキスト 🤖 emoji",
         "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"]
CHAT = ["<|im_start|>", "<|im_end|>"]


def _bpe_files(tmp_path) -> tuple[str, str]:
    """GPT-2's vocab.json + merges.txt (the repository's fixture), else a byte-level BPE trained
    here with the tokenizers library."""
    for folder in (os.path.join(REPO, "tests", "fixtures", "gpt2"), "/work/shared/data/tokenizers/gpt2"):
        vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        if os.path.isfile(vocab) and os.path.isfile(merges):
            return vocab, merges
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 50 + ["the quick brown fox jumps over the lazy dog"] * 50,
                            vocab_size=400, special_tokens=["<|endoftext|>"])
    out = tmp_path / "trained"
    out.mkdir()
    return tuple(bpe.save_model(str(out)))


def _folders(tmp_path, kind: str, old_config: bool):
    """(folder with tokenizer.json, folder with vocab.json + merges.txt + tokenizer_config.json,
    the transformers tokenizer)."""
    from transformers import GPT2Tokenizer, Qwen2Tokenizer
    vocab, merges = _bpe_files(tmp_path)
    if kind == "gpt2":
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": CHAT})
    full, mini = tmp_path / f"{kind}_full", tmp_path / f"{kind}_mini"
    tok.save_pretrained(full)
    mini.mkdir()
    shutil.copy(vocab, mini / "vocab.json")
    shutil.copy(merges, mini / "merges.txt")
    config = json.loads((full / "tokenizer_config.json").read_text())
    if old_config:  # transformers 4.x writes the added tokens with their ids
        for key in ("extra_special_tokens", "additional_special_tokens"):
            config.pop(key, None)
        config["added_tokens_decoder"] = {
            str(tok.convert_tokens_to_ids(t)): dict(content=t, lstrip=False, rstrip=False,
                                                    normalized=False, single_word=False, special=True)
            for t in CHAT}
    (mini / "tokenizer_config.json").write_text(json.dumps(config))
    return str(full), str(mini), tok


@pytest.mark.parametrize("kind,old_config", [("gpt2", False), ("gpt2", True), ("qwen2", True)])
def test_vocab_and_merges_folder_gives_the_tokenizer_json_ids(tmp_path, kind, old_config):
    full, mini, hf = _folders(tmp_path, kind, old_config)
    a = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=full)
    b = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=mini)
    assert (a.vocab_size, a.eod) == (b.vocab_size, b.eod) == (len(hf), hf.eos_token_id)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert a.encode(text) == b.encode(text) == ids, text
        assert b.decode(ids) == hf.decode(ids)
    assert b.encode(CHAT[1]) == [hf.convert_tokens_to_ids(CHAT[1])]  # one special token


def test_preprocess_data_gives_the_same_files_from_both_folders(tmp_path):
    from tests.test_data_preprocess import _load_tool
    tool = _load_tool("preprocess_data")
    full, mini, _ = _folders(tmp_path, "gpt2", True)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
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
