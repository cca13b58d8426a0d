"""Tokenizing long documents in bounded memory: slices cut where the tokenizer cannot tell.

A 50 MB document tokenized in one call costs gigabytes (the Rust tokenizer keeps offsets, strings
and pre-tokens for the whole text). GPT-2's byte-level BPE first splits text with its regex
(`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`), and no
pre-token of that regex holds a non-space character followed by a space. So a cut just before a
space, tab or newline that follows a non-space character is a pre-token boundary of the whole
text, and encoding the slices one by one gives exactly the ids of encoding the whole: documents
of any length are tokenized in slices of about SLICE_CHARS characters (ids kept as int32).

Other tokenizers (sentencepiece adds a prefix space to every call, Llama 3's regex joins
punctuation with the newlines after it) have no such cut: a document longer than
`max_unsliced_chars` is refused with a line naming its length and the limit instead of
exhausting memory. A GPT-2 document without any whitespace for more than a slice is tokenized
up to its next cut, however far that is.
"""
from __future__ import annotations

import re

import numpy as np

SLICE_CHARS = 1 << 20  # characters per slice (about 1 MB of text, a few hundred MB less memory)
MAX_UNSLICED_CHARS = 8_000_000  # default --max-unsliced-chars: ~1 GB of tokenizer memory
_CUT = re.compile(r"(?<=\S)[ \t\n]")  # Python's \S is narrower than Rust's: never a wrong cut


class DocumentTooLong(ValueError):
    """A document longer than the limit for a tokenizer that cannot be sliced safely."""


def sliceable(tokenizer) -> bool:
    """Whether slices cut by `safe_slices` encode to the ids of the whole text."""
    return type(tokenizer).__name__ == "GPT2BPETokenizer"


def safe_slices(text: str, size: int | None = None):
    """Pieces of `text`, each about `size` (default SLICE_CHARS) characters, cut only just before
    a space, tab or newline that follows a non-space character."""
    size, start = size or SLICE_CHARS, 0
    while len(text) - start > size:
        cut = None
        for m in _CUT.finditer(text, start + 1, start + size):
            cut = m.start()
        if cut is None:  # no cut in this window: take the first one after it
            m = _CUT.search(text, start + size)
            cut = m.start() if m else len(text)
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def too_long(tokenizer, text: str, max_unsliced_chars: int = MAX_UNSLICED_CHARS) -> str | None:
    """Why `text` cannot be tokenized in bounded memory by `tokenizer`; None when it can."""
    if sliceable(tokenizer) or len(text) <= max_unsliced_chars:
        return None
    return (f"document of {len(text):,} characters is longer than --max-unsliced-chars "
            f"{max_unsliced_chars:,} (this tokenizer cannot be cut safely); split it or raise the "
            f"limit (~125 bytes of memory per character)")


def encode_long(tokenizer, text: str, max_unsliced_chars: int = MAX_UNSLICED_CHARS) -> np.ndarray:
    """The ids of one long document (int32), in bounded memory where the tokenizer allows."""
    problem = too_long(tokenizer, text, max_unsliced_chars)
    if problem:
        raise DocumentTooLong(problem)
    if not sliceable(tokenizer):
        return np.asarray(tokenizer.encode(text), dtype=np.int32)
    return np.concatenate([np.asarray(tokenizer.encode(piece), dtype=np.int32)
                           for piece in safe_slices(text)] or [np.zeros(0, np.int32)])
