"""Verifiable rewards for the GRPO example: the prompts are "a + b =" with one-digit a and b."""
from __future__ import annotations


def sum_digit(prompts, completions, answer, **kw):
    """1 when the completion's first word is the last digit of a + b (the record's `answer`),
    plus 0.1 for each other word that is a digit; 0 otherwise."""
    out = []
    for text, want in zip(completions, answer):
        words = text.split()
        first = 1.0 if words and words[0] == str(want) else 0.0
        out.append(first + 0.1 * sum(w.isdigit() for w in words[1:]))
    return out


def sevens(prompts, completions, **kw):
    """The share of the completion's words that are "7" (a reward on the completion alone)."""
    return [sum(w == "7" for w in c.split()) / max(len(c.split()), 1) for c in completions]


def sum_first(prompts, completions, total, **kw):
    """1 when the completion starts with the digits of a + b (the record's `total`, "1 2" for
    12), else 0: the answer is checked, nothing else."""
    out = []
    for text, want in zip(completions, total):
        digits = list(str(want))
        out.append(1.0 if text.split()[:len(digits)] == digits else 0.0)
    return out
