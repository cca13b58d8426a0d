"""One tokenizer interface (encode, decode, eod, vocab_size) over the formats Megatron users have.

- GPT-2 byte-level BPE files: ``vocab.json`` + ``merges.txt`` (Hugging Face names) or
  ``encoder.json`` + ``vocab.bpe`` (OpenAI's names); the contents are the same format.
- A Hugging Face ``tokenizer.json`` or a local tokenizer folder.
- A sentencepiece ``.model``.

Everything runs on the Rust ``tokenizers`` library or sentencepiece's C++; nothing is downloaded.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Sequence

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


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE; ids equal transformers' GPT2Tokenizer on the same files."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        _require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust error is terse; say which files and what they must be
            raise TokenizerError(
                f"{vocab_file} / {merge_file}: not a GPT-2 vocab (json) + merges (text) pair ({e}); "
                "pass vocab.json+merges.txt or encoder.json+vocab.bpe"
            ) from e
        tok = Tokenizer(bpe)
        # GPT-2 splits with its own regex over bytes mapped to printable unicode; no prefix space.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if GPT2_EOD not in vocab:
            raise TokenizerError(f"{vocab_file}: has no {GPT2_EOD!r} token; is it a GPT-2 vocabulary?")
        # Registered as special so the literal string "<|endoftext|>" in text maps to the id,
        # as transformers' GPT-2 tokenizer does.
        tok.add_special_tokens([GPT2_EOD])
        self.eod = vocab[GPT2_EOD]
        self.vocab_size = len(vocab)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking, which preprocessing never uses (~1.4x faster).
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` file, or a local folder loadable by AutoTokenizer."""

    def __init__(self, path: str) -> None:
        _require_file(path, "--tokenizer-model", "HuggingFaceTokenizer")
        json_file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        self._fast = None
        if os.path.isfile(json_file):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(json_file)
            vocab = self._fast.get_vocab(with_added_tokens=True)
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            vocab = self._hf.get_vocab()
            self.vocab_size = len(self._hf)
        eod = None
        for name in (GPT2_EOD, "</s>", "<|end_of_text|>", "<eos>", "[SEP]"):
            if name in vocab:
                eod = vocab[name]
                break
        if eod is None:
            raise TokenizerError(f"{path}: no end-of-document token (<|endoftext|>, </s>, ...) in the vocabulary; add one")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids))


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

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))  # one C++ call for the whole batch

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class NullTokenizer:
    """Megatron's NullTokenizer, for data tokenized elsewhere: text is space-separated ids, ids are
    0 .. --vocab-size - 1, and the end-of-document id is --vocab-size (so the vocabulary holds
    --vocab-size + 1 ids)."""

    def __init__(self, vocab_size: int | None) -> None:
        if not vocab_size or vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N (the ids of the "
                                 "pre-tokenized data are 0 .. N-1; N is the end-of-document id)")
        self.eod, self.vocab_size = vocab_size, vocab_size + 1

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


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
        tok = HFTokenizer(tokenizer_model)
    elif tokenizer_type in NULL_TYPES:
        tok = NullTokenizer(vocab_size)
    else:
        known = sorted(GPT2_TYPES | SENTENCEPIECE_TYPES | HF_TYPES | NULL_TYPES)
        raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; use one of {known}")
    logger.info("tokenizer %s: vocab size %d, eod %d", tokenizer_type, tok.vocab_size, tok.eod)
    return tok
