"""Tokenizer folders and chat data the tokenizer, SFT and conversion tests share (not a test
module): GPT-2's BPE files, ChatML's tokens and templates, one conversation."""
from __future__ import annotations

import json
import shutil

from tests.fixtures import GPT2


CHAT = ["<|im_start|>", "<|im_end|>"]


TOKENIZER_TEXTS = ["Hello world! <|endoftext|> naïve café 123 4567\n\n  spaces\tand tabs",
         "I'm here, don't you ALL'S", "日本語のテキスト 🤖 emoji",
         "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"]


def bpe_files(tmp_path) -> tuple[str, str]:
    """GPT-2's vocab.json + merges.txt (the repository's fixture)."""
    return str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt")


def tokenizer_folders(tmp_path, kind: str, old_config: bool):
    """(folder with tokenizer.json, folder with vocab.json + merges.txt + tokenizer_config.json,
    the transformers tokenizer)."""
    from transformers import GPT2Tokenizer, Qwen2Tokenizer
    vocab, merges = bpe_files(tmp_path)
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


# ChatML, once with the reply marked as generation and once without any mark.
CHATML_TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
                 "{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_PLAIN = CHATML_TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATION = {"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "hi there"},
                             {"role": "assistant", "content": "hello you"},
                             {"role": "user", "content": "and now"},
                             {"role": "assistant", "content": "bye"}]}


def chatml_tokenizer(template: str | None):
    """transformers' GPT-2 tokenizer from the fixture, with ChatML's tokens and `template`."""
    from transformers import GPT2TokenizerFast
    tok = GPT2TokenizerFast(str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))
    tok.add_special_tokens({"additional_special_tokens": CHAT})
    tok.chat_template = template
    return tok
