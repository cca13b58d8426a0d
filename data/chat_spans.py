"""Where each assistant reply lies in the whole rendering of a conversation.

Released chat templates do not render a conversation's prefix as a prefix of the conversation:
Qwen3 and DeepSeek-R1 drop the reasoning of earlier assistant turns, gpt-oss drops earlier analysis
channels, Mistral moves the system prompt to the last user turn, the DeepSeek-R1 distills prompt
with ``<think>\\n`` that past turns never show. So the replies are located in the rendering of the
whole conversation (what the model sees at inference), without token prefixes:

- every message's content gets a private-use marker after its last non-space character and the
  conversation is rendered again; with the markers removed it must equal the plain rendering
  (else the template rewrites contents and nothing here is trusted), and the marker of each
  assistant message must occur once: it is where the reply's text ends;
- the reply starts where the template's generation prompt ends: the text after the previous
  message's marker in the rendering of the conversation up to the turn with
  ``add_generation_prompt``, as far as it agrees with the whole rendering (R1's ``<think>\\n``
  prompt agrees up to ``<｜Assistant｜>``);
- the reply ends with the first special token after its text, with only white space in between
  (the end-of-turn token: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``,
  ``<|return|>``...); what follows it (a newline before the next turn) is not learned.

Character spans become token spans through the fast tokenizer's offsets: a token is learned when it
overlaps a span. Anything that cannot be located raises `Unlocatable` with the reason.
"""
from __future__ import annotations

import bisect
import re

_MARK = re.compile("\ue000([0-9]+)\ue001")


class Unlocatable(ValueError):
    """An assistant reply cannot be located in the rendering; the message says why."""


def _mark(k: int) -> str:
    return f"\ue000{k}\ue001"


def marked(messages: list[dict]) -> list[dict]:
    """`messages` with message k's content followed by marker k (before its trailing white space,
    which templates often trim)."""
    out = []
    for k, m in enumerate(messages):
        text = m["content"]
        body = text.rstrip()
        out.append({**m, "content": body + _mark(k) + text[len(body):]})
    return out


def _markers(text: str) -> tuple[str, dict[int, list[int]]]:
    """`text` without markers, and for each marker the positions (in that text) where it was."""
    plain, where, last, removed = [], {}, 0, 0
    for m in _MARK.finditer(text):
        plain.append(text[last:m.start()])
        where.setdefault(int(m.group(1)), []).append(m.start() - removed)
        removed += m.end() - m.start()
        last = m.end()
    plain.append(text[last:])
    return "".join(plain), where


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _opening(render, full: str, end: int) -> int:
    """Start of a reply that opens the conversation: after the last generation prompt (as the
    template writes it after one user turn) before `end`; 0 where there is none."""
    probe = [{"role": "user", "content": "\ue002"}]
    try:
        bare, prompted = render(probe, False), render(probe, True)
    except ValueError:  # the template refuses the probe
        return 0
    prompt = prompted[len(bare):] if prompted.startswith(bare) else ""
    k = full.rfind(prompt, 0, end) if prompt else -1
    return k + len(prompt) if k >= 0 else 0


def reply_spans(render, messages: list[dict], full: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Character spans (start of reply, end of its text) of the assistant messages in `full`, the
    plain rendering of `messages`; `render(messages, add_generation_prompt)` renders text. Also
    the indices of the messages whose content the template does not render at all."""
    text, where = _markers(render(marked(messages), False))
    if text != full:
        raise Unlocatable("the template changes message contents beyond trimming them, so the "
                          "replies cannot be located in its rendering")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        ends = where.get(i, [])
        if len(ends) != 1:
            raise Unlocatable("the template does not render an assistant reply's text exactly once")
        start = 0
        if not i:
            start = _opening(render, full, ends[0])
        else:
            anchor = where.get(i - 1, [])
            before, at = _markers(render(marked(messages[:i]), True))
            if len(anchor) != 1 or len(at.get(i - 1, [])) != 1:
                raise Unlocatable("the template does not render the message before an assistant "
                                  "reply exactly once")
            prompt = before[at[i - 1][0]:]
            start = anchor[0] + _common(prompt, full[anchor[0]:ends[0]])
        spans.append((start, ends[0]))
    missing = [k for k in range(len(messages)) if k not in where and messages[k]["content"].strip()]
    return spans, missing


def token_mask(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], special: list[bool],
               full: str) -> list[int]:
    """The learned-token mask of a rendering tokenized with `offsets` (per token, into `full`, in
    order): each span extended through the first special token after it (white space only in
    between); a token is learned when it overlaps a span."""
    mask = [0] * len(offsets)
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    for start, end in spans:
        close = next((j for j in range(bisect.bisect_left(starts, end), len(offsets))
                      if special[j]), None)
        if close is None or full[end:starts[close]].strip():
            raise Unlocatable("no special end-of-turn token right after an assistant reply (the "
                              "template closes the turn with text)")
        for j in range(bisect.bisect_left(ends, start), close + 1):
            if ends[j] > start or starts[j] == ends[j]:
                mask[j] = 1
    return mask
