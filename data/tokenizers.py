"""One tokenizer interface (encode, decode, eod, vocab_size) over the formats Megatron users have.

- GPT-2 byte-level BPE files: ``vocab.json`` + ``merges.txt`` (Hugging Face names) or
  ``encoder.json`` + ``vocab.bpe`` (OpenAI's names); the contents are the same format.
- A Hugging Face ``tokenizer.json`` or a local tokenizer folder (tokenizer.json; else vocab.json +
  merges.txt built as transformers builds byte-level BPE; else a sentencepiece tokenizer.model).
- A sentencepiece ``.model``.

Everything runs on the Rust ``tokenizers`` library or sentencepiece's C++; nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Sequence

from megazoo.data.gpt2_words import WordCache

logger = logging.getLogger(__name__)

GPT2_EOD = "<|endoftext|>"
# Megatron --tokenizer-type names (and a few short aliases) accepted by build_tokenizer.
GPT2_TYPES = {"GPT2BPETokenizer", "gpt2"}
SENTENCEPIECE_TYPES = {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "sentencepiece"}
HF_TYPES = {"HuggingFaceTokenizer", "huggingface"}
NULL_TYPES = {"NullTokenizer"}


class TokenizerError(ValueError):
    """A missing or unusable tokenizer file; the message names the file and the fix."""


def _require_file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerError(f"{kind} needs {flag}; pass the file path")
    if not os.path.exists(path):
        raise TokenizerError(f"{path}: not found; check {flag}")
    return path


# transformers' Qwen2Tokenizer splits text with this pattern (then byte-level without a regex)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


# tokenizer_config.json classes whose vocab.json + merges.txt alone define the tokenizer (GPT-2's
# byte-level pre-tokenizer, or Qwen2's split pattern), checked against transformers.AutoTokenizer.
# Any other class (PreTrainedTokenizerFast names SmolLM2's; LlamaTokenizerFast, ...) keeps its
# normalizer and pre-tokenizer in tokenizer.json only: without that file the ids would differ.
GPT2_LIKE_CLASSES = {"GPT2Tokenizer", "RobertaTokenizer", "BartTokenizer", "CodeGenTokenizer",
                     "GPTNeoXTokenizer"}
QWEN2_CLASSES = {"Qwen2Tokenizer"}


def _vocab_merges_split(folder: str, config: dict) -> bool:
    """Whether a vocab.json + merges.txt folder is built with Qwen2's split (else GPT-2's);
    a class whose pre-tokenizer lives only in tokenizer.json is refused."""
    named = config.get("tokenizer_class")
    base = str(named or "GPT2Tokenizer").removesuffix("Fast")
    if base in QWEN2_CLASSES:
        return True
    if base in GPT2_LIKE_CLASSES:
        return False
    raise TokenizerError(
        f"{os.path.join(folder, 'tokenizer_config.json')}: tokenizer_class {named!r} keeps its "
        f"normalizer and pre-tokenizer in tokenizer.json, which {folder} lacks (vocab.json + "
        f"merges.txt alone would split text differently); copy the model's tokenizer.json into it")


def byte_level_bpe(vocab_file: str, merge_file: str, *, add_prefix_space: bool = False,
                   qwen2_split: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` from vocab (json) + merges (text), built as
    transformers converts GPT2Tokenizer (or, with `qwen2_split`, Qwen2Tokenizer: NFC and its
    split pattern)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    try:
        bpe = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:  # the Rust error is terse; say which files and what they must be
        raise TokenizerError(
            f"{vocab_file} / {merge_file}: not a byte-level BPE vocab (json) + merges (text) pair "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass vocab.json+merges.txt "
            "or encoder.json+vocab.bpe") from None
    tok = Tokenizer(bpe)
    if qwen2_split:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
    else:  # GPT-2's own regex over bytes mapped to printable unicode
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode())
    return h.hexdigest()[:16]


def rust_fingerprint(tok) -> str:
    """The identity of a `tokenizers.Tokenizer`: its vocabulary with the added tokens, the
    model's merges, normalizer and pre-tokenizer (what decides the ids of a text). Options that
    do not change ids (decoder, offsets, padding) are left out, so the same tokenizer built from
    tokenizer.json or from vocab.json + merges.txt gives the same fingerprint."""
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return "tokenizers:" + _digest(model.get("type"), sorted(tok.get_vocab(with_added_tokens=True).items()),
                                   merges, spec.get("normalizer"), spec.get("pre_tokenizer"))


def same_tokenizer(a: str, b: str) -> bool | None:
    """Whether two fingerprints name the same tokenizer; None when they come from different
    libraries (a sentencepiece model and its tokenizer.json conversion may give the same ids, which
    fingerprints cannot tell)."""
    if a.split(":")[0] != b.split(":")[0]:
        return None
    return a == b


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE; ids equal transformers' GPT2Tokenizer on the same files."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        _require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        tok = byte_level_bpe(vocab_file, merge_file)
        self._tok = tok
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if GPT2_EOD not in vocab:
            raise TokenizerError(f"{vocab_file}: has no {GPT2_EOD!r} token; is it a GPT-2 vocabulary?")
        # Registered as special so the literal string "<|endoftext|>" in text maps to the id,
        # as transformers' GPT-2 tokenizer does.
        tok.add_special_tokens([GPT2_EOD])
        self._words = WordCache(tok, [GPT2_EOD])
        self.eod = vocab[GPT2_EOD]
        self.vocab_size = len(vocab)
        self.pad = None  # GPT-2 has no padding token

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._words.encode_batch(texts)  # the same ids, through a per-word cache

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        return rust_fingerprint(self._tok)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e}); repair or remove it") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _add_folder_tokens(tok, folder: str, config: dict) -> None:
    """The added and special tokens of tokenizer_config.json / added_tokens.json /
    special_tokens_map.json, with the ids those files give them (as transformers loads them)."""
    from tokenizers import AddedToken

    wanted: dict[int, tuple[str, dict]] = {}
    for tid, spec in (config.get("added_tokens_decoder") or {}).items():
        flags = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                 if k in spec}
        wanted[int(tid)] = (spec["content"], flags)
    for content, tid in _read_json(os.path.join(folder, "added_tokens.json")).items():
        wanted.setdefault(int(tid), (content, {"special": True}))
    specials = {**config, **_read_json(os.path.join(folder, "special_tokens_map.json"))}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        text = _token_text(specials.get(key))
        tid = tok.token_to_id(text) if text else None
        if tid is not None:
            wanted.setdefault(tid, (text, {"special": True}))
    for tid in sorted(wanted):
        content, flags = wanted[tid]
        flags.setdefault("special", True)
        if flags.get("special"):  # transformers keeps special tokens un-normalised
            flags.setdefault("normalized", False)
        tok.add_tokens([AddedToken(content, **flags)])
        if tok.token_to_id(content) != tid:
            raise TokenizerError(f"{folder}: added token {content!r} gets id {tok.token_to_id(content)}"
                                 f", the tokenizer files say {tid}; the files do not belong together")
    for key in ("additional_special_tokens", "extra_special_tokens"):  # no ids: appended in order
        extra = specials.get(key) or []
        for value in (extra.values() if isinstance(extra, dict) else extra):
            tok.add_tokens([AddedToken(_token_text(value), special=True, normalized=False)])


def load_hf_folder(path: str):
    """(tokenizers.Tokenizer or None, tokenizer_config dict) of a Hugging Face tokenizer: a
    tokenizer.json file or a folder holding one, else vocab.json + merges.txt built as transformers
    does for byte-level BPE. None when the folder has neither (a sentencepiece folder)."""
    from tokenizers import Tokenizer

    folder = os.path.dirname(path) if path.endswith(".json") else path
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    json_file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_file):
        try:
            return Tokenizer.from_file(json_file), config
        except Exception as e:  # noqa: BLE001 - the Rust error is one terse line
            raise TokenizerError(f"{json_file}: not a tokenizers JSON file ({e}); pass another "
                                 f"--tokenizer-model") from None
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        return None, config
    tok = byte_level_bpe(vocab, merges, add_prefix_space=bool(config.get("add_prefix_space", False)),
                         qwen2_split=_vocab_merges_split(folder, config))
    _add_folder_tokens(tok, folder, config)
    return tok, config


def chat_template_of(folder: str, config: dict) -> str | None:
    """The chat template of a tokenizer folder (chat_template.jinja or tokenizer_config.json)."""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


class HFTokenizer:
    """A Hugging Face tokenizer: ``tokenizer.json``, or a folder with tokenizer.json or
    vocab.json + merges.txt (+ tokenizer_config.json's special tokens); `chat_template` and the
    special-token strings come from the folder's tokenizer_config.json."""

    def __init__(self, path: str, tok=None, config: dict | None = None) -> None:
        _require_file(path, "--tokenizer-model", "HuggingFaceTokenizer")
        if tok is None:
            tok, config = load_hf_folder(path)
        if tok is None:
            raise TokenizerError(f"{path}: no tokenizer.json, vocab.json + merges.txt or "
                                 f"tokenizer.model; pass --tokenizer-model <tokenizer folder>")
        self._fast, self.config = tok, config or {}
        self.folder = os.path.dirname(path) if path.endswith(".json") else path
        self.chat_template = chat_template_of(self.folder, self.config)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eod = None
        for name in (GPT2_EOD, "</s>", "<|end_of_text|>", "<eos>", "[SEP]"):
            if name in vocab:
                eod = vocab[name]
                break
        if eod is None:
            raise TokenizerError(f"{path}: no end-of-document token (<|endoftext|>, </s>, ...) in the vocabulary; add one")
        self.eod = eod
        # the folder's pad and eos tokens (tokenizer_config.json, special_tokens_map.json), by id
        specials = {**self.config, **_read_json(os.path.join(self.folder, "special_tokens_map.json"))}
        self.pad, self.eos = (vocab.get(_token_text(specials.get(k)) or "") for k in ("pad_token", "eos_token"))
        self.special_ids = {vocab[t] for k, v in specials.items()  # bos, unk, ... (not pad)
                            if k.endswith("_token") and k != "pad_token"
                            and (t := _token_text(v)) is not None and t in vocab}

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as strings (for chat templates)."""
        return {k: _token_text(v) for k, v in self.config.items()
                if k.endswith("_token") and _token_text(v) is not None}

    def encode(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fast = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._fast.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        return rust_fingerprint(self._fast)


class SentencePieceTokenizer:
    """A sentencepiece ``.model``; eod is its ``</s>`` (eos) id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        _require_file(model_file, "--tokenizer-model", "SentencePieceTokenizer")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as e:
            raise TokenizerError(f"{model_file}: not a sentencepiece model ({e}); pass a .model file") from e
        self.vocab_size = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        if eos < 0:
            raise TokenizerError(f"{model_file}: model has no eos id; retrain with --eos_id set")
        self.eod = eos
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None  # -1: the model has none
        self.special_ids = {i for i in (self._sp.bos_id(), self._sp.unk_id(), eos) if i >= 0}

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))  # one C++ call for the whole batch

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        """The model proto: pieces, scores and the normalizer spec."""
        return "sentencepiece:" + _digest(self._sp.serialized_model_proto())


class NullTokenizer:
    """Megatron's NullTokenizer, for data tokenized elsewhere: text is space-separated ids, ids are
    0 .. --vocab-size - 1, and the end-of-document id is --vocab-size (so the vocabulary holds
    --vocab-size + 1 ids)."""

    def __init__(self, vocab_size: int | None) -> None:
        if not vocab_size or vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N (the ids of the "
                                 "pre-tokenized data are 0 .. N-1; N is the end-of-document id)")
        self.eod, self.vocab_size = vocab_size, vocab_size + 1
        self.pad = None

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def fingerprint(self) -> str:
        return f"null:{self.vocab_size}"


def loss_pad_id(tok) -> int | None:
    """The pad id whose labels megatron-core's GPTDataset leaves out of the loss (and maps to 0):
    the tokenizer's pad id when it has one and it is none of its other special tokens (end of
    document, eos, bos, unk, ...: megatron-core compares it with every one and then falls back to
    -1, an id no data holds); else None."""
    pad = getattr(tok, "pad", None)
    if pad is None or pad < 0:
        return None
    if pad in (tok.eod, getattr(tok, "eos", None)) or pad in getattr(tok, "special_ids", ()):
        logger.info("the tokenizer's pad id %d is also another of its special tokens: no pad "
                    "masking (as megatron-core)", pad)
        return None
    return pad


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
):
    """Build a tokenizer from Megatron-style arguments."""
    if tokenizer_type in GPT2_TYPES:
        tok = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type in SENTENCEPIECE_TYPES:
        tok = SentencePieceTokenizer(tokenizer_model)
    elif tokenizer_type in HF_TYPES:
        _require_file(tokenizer_model, "--tokenizer-model", "HuggingFaceTokenizer")
        fast, config = load_hf_folder(tokenizer_model)
        sp_model = os.path.join(tokenizer_model, "tokenizer.model")
        if fast is None and os.path.isfile(sp_model):  # a sentencepiece-only folder
            tok = SentencePieceTokenizer(sp_model)
        else:
            tok = HFTokenizer(tokenizer_model, fast, config)
    elif tokenizer_type in NULL_TYPES:
        tok = NullTokenizer(vocab_size)
    else:
        known = sorted(GPT2_TYPES | SENTENCEPIECE_TYPES | HF_TYPES | NULL_TYPES)
        raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; use one of {known}")
    logger.info("tokenizer %s: vocab size %d, eod %d", tokenizer_type, tok.vocab_size, tok.eod)
    return tok
