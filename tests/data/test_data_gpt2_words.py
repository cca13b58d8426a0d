"""The GPT-2 word cache (data/gpt2_words.py) gives the Rust tokenizer's ids on every text."""
import random

from megazoo.data.gpt2_words import UNSURE
from megazoo.data.tokenizers import GPT2BPETokenizer
from tests.fixtures import GPT2

# contexts that exercise each class of the split: letters, digits, punctuation, whitespace runs
# before a word (the look-ahead), contractions
CONTEXTS = ("a{}b", " {} ", "1{}2", "!{}?", "{}a", "{}  x", "x'{}s", "{}\n\n y", " {}{}{}")


def _tokenizer():
    return GPT2BPETokenizer(str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))


def _rust(tok, texts):
    return [e.ids for e in tok._tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def test_every_cached_code_point_splits_as_the_rust_tokenizer():
    """Each code point the cache takes, in every context, and texts mixing them at random."""
    tok = _tokenizer()
    safe = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and UNSURE.match(chr(c)) is None]
    assert 2100 < len(safe) < 2200  # U+0000-U+07FF, two punctuation runs, the euro sign
    texts = [f.format(*[c] * f.count("{}")) for c in safe for f in CONTEXTS]
    rng = random.Random(0)
    alphabet = safe + [" ", " ", "  ", "\n", "'s", "'ll", "the", " and", "42"]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 80))) for _ in range(3000)]
    for start in range(0, len(texts), 4096):  # batches share the cache, as preprocessing's do
        batch = texts[start:start + 4096]
        assert tok.encode_batch(batch) == _rust(tok, batch)


def test_other_texts_go_through_the_rust_tokenizer_whole():
    """Characters the two regex engines classify differently (new in Unicode 16/17), others
    beyond the safe ranges, and the end-of-text token's string keep the Rust tokenizer's ids."""
    tok = _tokenizer()
    # the two engines split "\u088f's" and "\U00010940's" differently (new letters)
    texts = ["\u088f's", "Sidetic \U00010940's", "Garay \U00010d40\U00010d41 and \u088f",
             "emoji \U0001f600 x", "日本語 text",
             "one<|endoftext|>two", "a\u3000b", "", "plain ascii after the others"]
    assert tok.encode_batch(texts) == _rust(tok, texts)
    assert tok.encode_batch(["one<|endoftext|>two"])[0].count(tok.eod) == 1
