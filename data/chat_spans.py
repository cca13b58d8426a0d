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

An assistant turn with ``tool_calls`` (content empty or None) has no text of its own to mark: the
marker goes after the last string value of its last call's arguments (the end of the arguments
when they are a JSON string), and the turn runs through the last special token of the text that
the rendering of the conversation up to and including the turn writes after that marker, as far
as the whole rendering agrees with it: the rest of the call and the end-of-turn token
(``}}\n</tool_call><|im_end|>``, ``<|call|>``, ``</s>``, DeepSeek's ``<｜tool▁calls▁end｜>
<｜end▁of▁sentence｜>``). A template that does not render the marked call raises
`ToolCallsNotRendered` (it ignores ``tool_calls``: nothing could be learned of the turn).

Character spans become token spans through the fast tokenizer's offsets: a token is learned when it
overlaps a span. Anything that cannot be located raises `Unlocatable` with the reason.
"""
from __future__ import annotations

import bisect
import copy
import re

_MARK = re.compile("\ue000(-?[0-9]+)\ue001")


class Unlocatable(ValueError):
    """An assistant reply cannot be located in the rendering; the message says why."""


class ToolCallsNotRendered(ValueError):
    """The template renders nothing of an assistant turn's tool calls."""


def _mark(k: int) -> str:
    return f"\ue000{k}\ue001"


def _call_mark(k: int) -> int:
    """The marker id of message k's tool calls (content markers are 0, 1, ...)."""
    return -1 - k


def _mark_arguments(value, mark: str):
    """`value` (tool-call arguments: a dict, or a JSON string) with `mark` after its last string
    value (after the string itself when it is one); None where it holds no string."""
    if isinstance(value, str):
        return value + mark
    keys = (list(value) if isinstance(value, dict)
            else range(len(value)) if isinstance(value, list) else [])
    for key in reversed(keys):
        inner = _mark_arguments(value[key], mark)
        if inner is not None:
            return ({**value, key: inner} if isinstance(value, dict)
                    else value[:key] + [inner] + value[key + 1:])
    return None


def marked(messages: list[dict]) -> list[dict]:
    """`messages` with message k's content followed by marker k (before its trailing white space,
    which templates often trim; none for empty or None content), and an assistant turn's tool
    calls marked at the end of the last call's arguments (`_call_mark`)."""
    out = []
    for k, m in enumerate(messages):
        m = dict(m)
        text = m.get("content")
        if isinstance(text, str) and text.strip():
            body = text.rstrip()
            m["content"] = body + _mark(k) + text[len(body):]
        if m.get("tool_calls"):
            calls = copy.deepcopy(m["tool_calls"])
            call = calls[-1].get("function", calls[-1]) if isinstance(calls[-1], dict) else None
            args = _mark_arguments(call.get("arguments"), _mark(_call_mark(k))) if call else None
            if args is None:
                raise Unlocatable("a tool call whose arguments hold no string value, so the call "
                                  "cannot be marked in the rendering")
            call["arguments"] = args
            m["tool_calls"] = calls
        out.append(m)
    return out


def unrendered_calls(render, messages: list[dict]) -> list[int]:
    """Indices of the assistant messages whose tool calls the template does not render: their
    marker is missing, or (calls that cannot be marked) the rendering without any tool calls is
    the same."""
    calls = [k for k, m in enumerate(messages) if m.get("tool_calls")]
    try:
        _, where = _markers(render(marked(messages), False))
    except Unlocatable:
        bare = [{key: v for key, v in m.items() if key != "tool_calls"} for m in messages]
        try:
            return calls if render(bare, False) == render(messages, False) else []
        except ValueError:  # the template refuses the turns without their calls
            return []
    return [k for k in calls if _call_mark(k) not in where]


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


def _call_end(render, messages: list[dict], i: int, full: str, end: int) -> int:
    """Where the text the template writes after assistant message i's tool-call marker stops
    agreeing with `full` (from `end`), in the rendering of the conversation through message i."""
    through, at = _markers(render(marked(messages[:i + 1]), False))
    if len(at.get(_call_mark(i), [])) != 1:
        raise Unlocatable("the template does not render a tool call exactly once when it ends the "
                          "conversation")
    tail = through[at[_call_mark(i)][0]:]
    return end + _common(tail, full[end:])


def reply_spans(render, messages: list[dict], full: str
                ) -> tuple[list[tuple[int, int, int | None]], list[int]]:
    """Character spans (start of reply, end of its text, and for a tool-call turn where the
    rendered call can end, else None) of the assistant messages in `full`, the plain rendering
    of `messages`; `render(messages, add_generation_prompt)` renders text. Also the indices of
    the messages whose content the template does not render at all. Raises
    `ToolCallsNotRendered` for a template that ignores an assistant turn's tool calls."""
    text, where = _markers(render(marked(messages), False))
    if text != full:
        raise Unlocatable("the template changes message contents beyond trimming them, so the "
                          "replies cannot be located in its rendering")
    ignored = [k for k, m in enumerate(messages)
               if m.get("tool_calls") and _call_mark(k) not in where]
    if ignored:
        raise ToolCallsNotRendered(f"message {ignored[0]}")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        ends = where.get(_end_mark(messages, i), [])
        if len(ends) != 1:
            raise Unlocatable("the template does not render an assistant reply's text exactly once")
        start = 0
        if not i:
            start = _opening(render, full, ends[0])
        else:
            anchor = where.get(_end_mark(messages, i - 1), [])
            before, at = _markers(render(marked(messages[:i]), True))
            if len(anchor) != 1 or len(at.get(_end_mark(messages, i - 1), [])) != 1:
                raise Unlocatable("the template does not render the message before an assistant "
                                  "reply exactly once")
            prompt = before[at[_end_mark(messages, i - 1)][0]:]
            start = anchor[0] + _common(prompt, full[anchor[0]:ends[0]])
        stop = _call_end(render, messages, i, full, ends[0]) if m.get("tool_calls") else None
        spans.append((start, ends[0], stop))
    missing = [k for k, m in enumerate(messages) if k not in where and isinstance(
        m.get("content"), str) and m["content"].strip()]
    return spans, missing


def _end_mark(messages: list[dict], k: int) -> int:
    """The marker that ends message k's text: its tool calls' where it has them, else its own."""
    return _call_mark(k) if messages[k].get("tool_calls") else k


def token_mask(spans: list[tuple[int, int, int | None]], offsets: list[tuple[int, int]],
               special: list[bool], full: str) -> list[int]:
    """The learned-token mask of a rendering tokenized with `offsets` (per token, into `full`, in
    order): each span (start, end, stop) extended through the first special token after `end`
    (white space only in between), or with a `stop` (a tool call) through the last special
    token that ends by `stop`; a token is learned when it overlaps a span."""
    mask = [0] * len(offsets)
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    for start, end, stop in spans:
        first = bisect.bisect_left(starts, end)
        if stop is None:
            close = next((j for j in range(first, len(offsets)) if special[j]), None)
            if close is None or full[end:starts[close]].strip():
                raise Unlocatable("no special end-of-turn token right after an assistant reply "
                                  "(the template closes the turn with text)")
        else:
            close = next((j for j in reversed(range(first, bisect.bisect_right(ends, stop)))
                          if special[j]), None)
            if close is None:
                raise Unlocatable("no special end-of-turn token after an assistant turn's tool "
                                  "call (the template closes the turn with text)")
        for j in range(bisect.bisect_left(ends, start), close + 1):
            if ends[j] > start or starts[j] == ends[j]:
                mask[j] = 1
    return mask
