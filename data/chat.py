"""Conversations into tokens and an assistant mask, with the checkpoint's own chat template.

A record is either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles system, user,
assistant, tool) or a prompt/completion pair: ``{"prompt": str | messages, "completion": str |
messages}`` (strings become one user turn and one assistant turn; a prompt whose last message is
the assistant's, a prefix to continue, is skipped: `refuse_assistant_prefix`). Of a
prompt/completion pair only the completion's assistant messages are learned, as TRL 1.16's
`completion_only_loss`: the prompt's assistant turns are context (docs/sft.md says where the
masks differ: a completion's tool outputs are not learned). Tool use as transformers and
TRL carry it: a record-level ``"tools"`` list of JSON schemas (or its JSON text), passed to the
template; assistant messages with ``"tool_calls"`` (content "" or None) are learned like any
reply (the rendered call and its end-of-turn token), ``"tool"`` messages (the tool's output)
are not. A template that ignores an assistant turn's tool calls skips the record; one that
renders nothing of ``tools`` is logged once.

The tokens are those of the whole conversation's rendering (``apply_chat_template``: what the
model sees at inference). The assistant mask marks the tokens the model learns to produce:

- with a template that marks them (``{% generation %}...{% endgeneration %}``), transformers' own
  ``return_assistant_tokens_mask``;
- otherwise, with a fast tokenizer, each reply located in the whole rendering
  (`megazoo.data.chat_spans`): from the end of the generation prompt through the end-of-turn
  token after the reply's text. Released templates that render an earlier turn differently once
  later turns follow (reasoning dropped, system prompt moved) are handled so;
- failing that (a slow tokenizer, or a turn that cannot be located), by rendering prefixes: the
  conversation up to the turn with the generation prompt, then up to and including the turn;
  the tokens in between are the span, and a prefix rendering that is not a token prefix of the
  whole rendering skips the record with the reason.

`render(record, context=k)` learns only the assistant messages from message k on: the first k
are context (DPO's prompt, data/preference.py), rendered but not learned.

The mask is aligned with the tokens; the label shift (labels = tokens[1:], loss mask =
mask[1:]) happens when samples are cut (data/sft_dataset.py).

The records are read and checked by `megazoo.data.chat_records`. Records that cannot train
raise `SkipRecord` with a short reason, counted and listed by the
preprocessing tool (tools/preprocess_sft.py); so does a conversation the template itself refuses
(e.g. Mistral's and Gemma's "roles must alternate").
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np

from megazoo.data.chat_records import SkipRecord, conversation_of, tools_of
from megazoo.data.chat_spans import (ToolCallsNotRendered, Unlocatable, reply_spans, token_mask,
                                     unrendered_calls)

log = logging.getLogger(__name__)

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
OVERLONG = ("truncate", "drop")


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations; the message names the folder and the fix."""


@dataclass
class Rendered:
    tokens: np.ndarray  # int64 [n]
    assistant_mask: np.ndarray  # uint8 [n]: 1 where the token is produced by the assistant
    truncated: bool = False


class ChatRenderer:
    """Renders records with a transformers tokenizer's chat template; see the module docstring.

    `max_tokens` (the sample length + 1: inputs and their shifted labels) bounds a conversation:
    longer ones are truncated or dropped (`overlong`), and counted by the caller via
    `Rendered.truncated` or the "over-long" SkipRecord.
    """

    def __init__(self, tokenizer, *, max_tokens: int | None = None, overlong: str = "truncate",
                 name: str = "tokenizer"):
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatTemplateError(f"{name}: the tokenizer has no chat template (tokenizer_config."
                                    f"json 'chat_template' or chat_template.jinja); add the "
                                    f"checkpoint's template to the folder")
        self.tok, self.max_tokens, self.overlong = tokenizer, max_tokens, overlong
        self.marks_generation = bool(GENERATION_TAG.search(template))
        self.locates = bool(getattr(tokenizer, "is_fast", False))
        self.name = name
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                          if getattr(t, "special", False)}
        self._logged: set[str] = set()
        self.trims_marks = self.marks_generation and self.locates and self._marks_overreach()

    @property
    def method(self) -> str:
        """How assistant spans are found, in words (for summaries)."""
        if self.marks_generation:
            return ("the template's {% generation %} marks" + (", cut to the located replies"
                                                               if self.trims_marks else ""))
        if self.locates:
            return ("each reply located in the whole rendering (prefix renderings where it "
                    "cannot be)")
        return "rendered prefixes (a slow tokenizer gives no character offsets)"

    def _marks_overreach(self) -> bool:
        """Whether the template's {% generation %} spans cover tokens outside the located replies
        (SmolLM3's cover the role header and the newline after the end-of-turn token), checked
        on one probe conversation; such marks are then cut to the located replies per record."""
        probe = [{"role": role, "content": text} for role, text in
                 [("user", "hi there"), ("assistant", "hello you"), ("user", "and now"),
                  ("assistant", "bye")]]
        try:
            marked = self._apply(probe, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
            tokens, located = self._locate(probe)
        except (SkipRecord, Unlocatable):
            return False
        if list(marked["input_ids"]) != tokens:
            return False
        over = sum(m and not k for m, k in zip(marked["assistant_masks"], located))
        under = sum(k and not m for m, k in zip(marked["assistant_masks"], located))
        if under:
            log.warning("%s: the template's {%% generation %%} spans leave out %d tokens of the "
                        "assistant replies of a probe conversation (e.g. the end-of-turn token); "
                        "the model does not learn those tokens", self.name, under)
        if over:
            log.warning("%s: the template's {%% generation %%} spans cover %d tokens outside the "
                        "assistant replies of a probe conversation (e.g. the role header); the "
                        "masks keep only the marked tokens inside each located reply",
                        self.name, over)
        return bool(over)

    def _once(self, key: str, msg: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s: %s", self.name, msg)

    @classmethod
    def from_folder(cls, folder: str, **kw) -> "ChatRenderer":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"{folder}: not a Hugging Face tokenizer folder ({e}); pass "
                                    f"the checkpoint's tokenizer folder") from None
        return cls(tok, name=folder, **kw)

    def _apply(self, messages, **kw):
        """apply_chat_template, a conversation the template refuses skipped with its message."""
        from jinja2.exceptions import TemplateError
        try:
            return self.tok.apply_chat_template(messages, **kw)
        except TemplateError as e:
            raise SkipRecord(f"the chat template refuses the conversation: {e}") from None
        except TypeError as e:  # e.g. DeepSeek's templates add tool-call arguments to strings
            raise SkipRecord(f"the chat template fails on the record: {e} (DeepSeek's templates "
                             f"take tool-call arguments as a JSON string)") from None

    def _ids(self, messages: list[dict], tools=None, **kw) -> list[int]:
        return list(self._apply(messages, tokenize=True, return_dict=True, tools=tools,
                                **kw)["input_ids"])

    def _text(self, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> str:
        return self._apply(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                           tools=tools)

    def _check_tools(self, messages: list[dict], tools) -> None:
        """Skips a record whose tool calls the template does not render (nothing of the turn
        could be learned; e.g. SmolLM2, Phi-3, Phi-4); logs once a template that renders nothing
        of the record's tools (the model trains without them, as it would be prompted)."""
        def render(m, prompt):
            return self._text(m, prompt, tools)
        if any(m.get("tool_calls") for m in messages):
            ignored = unrendered_calls(render, messages)
            if ignored:
                raise SkipRecord(_IGNORED_CALLS)
        if tools and render(messages, False) == self._text(messages):
            self._once("tools", "the chat template renders nothing of the records' 'tools'; the "
                                "model trains without the tool schemas, as it would be prompted")

    def render(self, record: dict, *, context: int = 0) -> Rendered:
        """The record's tokens and learned-token mask. The first `context` messages are context
        only: their assistant turns are rendered but not learned (DPO's multi-turn prompts; a
        prompt/completion record's prompt is context too)."""
        (messages, own), tools = conversation_of(record), tools_of(record)
        context = max(context, own)
        if tools or any(m.get("tool_calls") for m in messages):
            self._check_tools(messages, tools)
        if self.marks_generation:
            out = self._apply(messages, tokenize=True, return_dict=True, tools=tools,
                              return_assistant_tokens_mask=True)
            tokens, mask = list(out["input_ids"]), list(out["assistant_masks"])
            if any(m["role"] == "assistant" for m in messages[:context]):
                mask = [m & k for m, k in zip(mask, self._replies_after(messages, context, tools))]
            elif self.trims_marks:
                try:
                    located = self._locate(messages, context, tools)[1]
                    mask = [m & k for m, k in zip(mask, located)]
                except Unlocatable as e:
                    self._once("untrimmed", f"{e}; such records keep the template's marks "
                                            f"as they are")
        elif self.locates:
            tokens, mask = self._located_spans(messages, context, tools)
        else:
            tokens, mask = self._prefix_spans(messages, context, tools)
        return self._bounded(tokens, mask)

    def render_batch(self, records: list) -> list:
        """`render` of each record (a `Rendered`, or the `SkipRecord` it raised), with one
        template call and one batched tokenizer call for the records that pass
        `conversation_of` (the ids and masks of each are those of its own call; per record when
        the template marks no generation span, when a record has tools or tool calls, when its
        prompt holds assistant turns, or when the batch fails)."""
        out: list = [None] * len(records)
        todo: list[tuple[int, list[dict], int]] = []
        for i, record in enumerate(records):
            try:
                messages, context = conversation_of(record)
                todo.append((i, messages, context))
            except SkipRecord as e:
                out[i] = e
        tooled = any("tools" in records[i] or any(m.get("tool_calls") for m in messages)
                     for i, messages, _ in todo)
        # the template's marks cover every assistant turn: a prompt's are cut per record
        whole = [(i, messages) for i, messages, context in todo
                 if not any(m["role"] == "assistant" for m in messages[:context])]
        if self.marks_generation and not self.trims_marks and whole and not tooled:
            try:
                batch = self.tok.apply_chat_template([m for _, m in whole], tokenize=True,
                                                     return_dict=True,
                                                     return_assistant_tokens_mask=True)
            except Exception:  # noqa: BLE001 - one record's template error: each alone says which
                batch = None
            if batch is not None:
                for (i, _), tokens, mask in zip(whole, batch["input_ids"], batch["assistant_masks"]):
                    out[i] = _outcome(self._bounded, list(tokens), list(mask))
                todo = [t for t in todo if out[t[0]] is None]
        for i, _, _ in todo:
            out[i] = _outcome(self.render, records[i])
        return out

    def _bounded(self, tokens: list[int], mask: list[int]) -> Rendered:
        """The rendered ids and mask, checked for an assistant token and cut to `max_tokens`."""
        if not any(mask):
            raise SkipRecord("the template marks no generation span (no assistant token)")
        truncated = False
        if self.max_tokens is not None and len(tokens) > self.max_tokens:
            if self.overlong == "drop":
                raise SkipRecord(f"over-long ({len(tokens)} tokens > {self.max_tokens})")
            tokens, mask, truncated = tokens[:self.max_tokens], mask[:self.max_tokens], True
            if not any(mask[1:]):
                raise SkipRecord(f"over-long ({len(tokens)} tokens): no assistant token left "
                                 f"after truncation")
        return Rendered(np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8),
                        truncated)

    def _replies_after(self, messages: list[dict], context: int, tools=None) -> list[int]:
        """The mask of the replies from message `context` on, to cut {% generation %} marks that
        also cover a prompt's assistant turns: located, else from the prefix renderings."""
        reason = "a slow tokenizer gives no character offsets"
        if self.locates:
            try:
                return self._locate(messages, context, tools)[1]
            except Unlocatable as e:
                reason = str(e)
        try:
            mask = self._prefix_spans(messages, context, tools)[1]
        except SkipRecord:
            raise SkipRecord(f"{reason}, and the prefix renderings disagree, so the template's "
                             f"{{% generation %}} marks cannot be cut to the reply after a prompt "
                             f"with assistant turns; give a template that closes each turn with "
                             f"a special token, or prompts without assistant turns") from None
        self._once("prefix", f"{reason}; its assistant spans come from prefix renderings")
        return mask

    def _located_spans(self, messages: list[dict], context: int = 0, tools=None
                       ) -> tuple[list[int], list[int]]:
        """Each reply from message `context` on located in the whole rendering
        (data/chat_spans.py); where it cannot be, the prefix renderings, and where those disagree
        too, the record is skipped."""
        try:
            tokens, mask = self._locate(messages, context, tools)
        except Unlocatable as e:
            try:
                prefix_tokens, mask = self._prefix_spans(messages, context, tools)
            except SkipRecord:
                raise SkipRecord(f"{e}; mark the replies with {{% generation %}} in the template "
                                 f"(TRL's training templates do)") from None
            self._once("prefix", f"{e}; its assistant spans come from prefix renderings")
            return prefix_tokens, mask
        return tokens, mask

    def _locate(self, messages: list[dict], context: int = 0, tools=None
                ) -> tuple[list[int], list[int]]:
        """Tokens of the whole rendering and the mask of the replies from message `context` on
        located in it (raises `Unlocatable`); a template that renders nothing of some message is
        logged once."""
        def render(m, prompt):
            return self._text(m, prompt, tools)
        full = render(messages, False)
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        tokens, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        try:
            spans, dropped = reply_spans(render, messages, full)
        except ToolCallsNotRendered:
            raise SkipRecord(_IGNORED_CALLS) from None
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = [span for i, span in zip(replies, spans) if i >= context]
        mask = token_mask(spans, offsets, [t in self._special for t in tokens], full)
        if dropped:
            roles = sorted({messages[k]["role"] for k in dropped})
            self._once("dropped:" + ",".join(roles),
                       f"the chat template renders nothing of some {'/'.join(roles)} messages' "
                       f"content (e.g. message {dropped[0]}); the model trains without them, "
                       f"as it would be prompted")
        return tokens, mask

    def _prefix_spans(self, messages: list[dict], context: int = 0, tools=None
                      ) -> tuple[list[int], list[int]]:
        tokens = self._ids(messages, tools)
        mask = [0] * len(tokens)
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < context:
                continue
            before = self._ids(messages[:i], tools, add_generation_prompt=True) if i else []
            through = self._ids(messages[:i + 1], tools)
            if tokens[:len(before)] != before or tokens[:len(through)] != through:
                raise SkipRecord("the template renders a conversation's prefix differently from "
                                 "the conversation (mark the reply with {% generation %})")
            mask[len(before):len(through)] = [1] * (len(through) - len(before))
        return tokens, mask


_IGNORED_CALLS = ("the chat template renders nothing of an assistant turn's tool_calls, so the "
                  "turn cannot be learned; use the checkpoint's tool-calling template")


def _outcome(fn, *args):
    """fn(*args), or the SkipRecord it raised."""
    try:
        return fn(*args)
    except SkipRecord as e:
        return e
