"""GPT-2 byte-level BPE over a cache of words: the same ids as the Rust tokenizer, less work.

GPT-2's tokenizer splits a text with one regular expression into words (pre-tokens) and runs BPE
on each word alone, so a word's ids never depend on its neighbours. Real corpora repeat their
words, and in the Rust tokenizer most of the time goes into the split, not the merges (profiled
on 39 MB of code and prose: 15 of 17 CPU seconds). This path splits with Python's `regex`
module (C, and faster than the Rust split), encodes each word it has not seen once through the
Rust tokenizer itself, and concatenates the cached ids: Megatron's own GPT-2 tokenizer caches
words the same way.

The two regex engines carry Unicode tables of different ages and disagree on the classes of
recently assigned characters (4,657 code points with tokenizers 0.23 and regex 2026.5 on
U+0000-U+10FFFF, all new in Unicode 16 and 17). So only texts whose characters lie in ranges both
have classified alike for decades take this path: U+0000-U+07FF (Latin, Greek, Cyrillic, Hebrew,
Arabic ...), the typographic punctuation U+2010-U+2027 and U+2030-U+205E, and the euro sign.
Any other text, and any text holding a special token's string, goes through the Rust tokenizer
whole. tests/data/test_data_gpt2_words.py checks equality on every code point of these ranges.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import regex

# GPT-2's split (openai/gpt-2 encoder.py; the Rust ByteLevel pre-tokenizer's use_regex pattern)
GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# a character outside the ranges both engines classify alike
UNSURE = regex.compile("[^\u0000-\u07ff\u2010-\u2027\u2030-\u205e\u20ac]")
MAX_CACHED_WORDS = 1 << 20  # a bound on memory (a few hundred MB at most); cleared when reached


class WordCache:
    """`encode_batch` of a Rust byte-level BPE `tokenizers.Tokenizer` with no normalizer and
    GPT-2's split, through a per-word id cache. `specials` are the added tokens' strings: a text
    holding one is encoded by the Rust tokenizer (which splits on them first)."""

    def __init__(self, rust_tokenizer, specials: Sequence[str]) -> None:
        self._rust = rust_tokenizer
        self._fast = getattr(rust_tokenizer, "encode_batch_fast", rust_tokenizer.encode_batch)
        self._specials = tuple(specials)
        self._ids: dict[str, list[int]] = {}

    def _rust_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._fast(texts, add_special_tokens=False)]

    def _cacheable(self, text: str) -> bool:
        return UNSURE.search(text) is None and not any(s in text for s in self._specials)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out: list = [None] * len(texts)
        rust = [i for i, t in enumerate(texts) if not self._cacheable(t)]
        for i, ids in zip(rust, self._rust_batch([texts[i] for i in rust])):
            out[i] = ids
        split = {i: GPT2_SPLIT.findall(t) for i, t in enumerate(texts) if out[i] is None}
        if len(self._ids) > MAX_CACHED_WORDS:
            self._ids.clear()
        unseen = list({w for words in split.values() for w in words if w not in self._ids})
        # each word alone through the Rust tokenizer: its split of one word is that word
        self._ids.update(zip(unseen, self._rust_batch(unseen)))
        lookup = self._ids.__getitem__
        for i, words in split.items():
            out[i] = list(chain.from_iterable(map(lookup, words)))
        return out
