"""GRPO's prompts: a jsonl of `prompt` (a string, encoded as is or, with chat, through the
tokenizer's chat template; or a list of messages, TRL's conversational prompt) or `messages` (a
chat, always templated, ready for the assistant's turn; it is the chat whenever present, even
beside a `prompt`); the messages are checked as chat SFT checks them (data/chat_records.py
`check_messages`: a non-empty list of {role, content}), a bad one refused in one line; a templated record's `tools` (JSON
schemas, or their JSON text, as in chat SFT) are passed to the template; each record's other
fields reach the reward function by name. A chat whose last message is the assistant's (a prefix
to continue) is refused, as chat SFT and DPO skip it (data/chat_records.py `refuse_assistant_prefix`):
TRL 1.16's GRPOTrainer renders it with the generation prompt, closing that message and sampling a
second assistant turn."""
from __future__ import annotations

import json

from megazoo.data.chat_records import SkipRecord, check_messages, refuse_template_kwargs, tools_of
from megazoo.data.tokenizers import TokenizerError


def render(tok, record: dict, chat: bool, where: str) -> list[int]:
    prompt = record.get("prompt")
    field = "messages" if "messages" in record else "prompt" if isinstance(prompt, list) else None
    if field is None and not isinstance(prompt, str):
        raise ValueError(f"{where}: `prompt` is neither a string nor a list of messages")
    conversation = record[field] if field else None  # `messages`: the chat whenever given
    try:  # the messages as chat SFT and DPO check them
        if field:
            check_messages(conversation)
    except SkipRecord as e:
        raise ValueError(f"{where}: `{field}`: {e}") from None
    try:  # (as chat SFT and DPO: a record's own template arguments are not applied)
        refuse_template_kwargs(record)
        tools = tools_of(record)
    except SkipRecord as e:
        raise ValueError(f"{where}: {e}") from None
    if conversation and isinstance(conversation[-1], dict) \
            and conversation[-1].get("role") == "assistant":
        raise ValueError(f"{where}: the chat ends with an assistant message, a prefix to continue, "
                         f"which TRL 1.16's GRPOTrainer closes and follows with a second assistant "
                         f"turn; end the prompt with a user or tool message")
    if conversation is not None or chat:
        template = getattr(tok, "chat_template", None)
        if not template:
            raise TokenizerError(f"{where}: the tokenizer has no chat template; give plain "
                                 f"`prompt` strings without the chat flag")
        from transformers.utils.chat_template_utils import render_jinja_template
        chat_ = conversation or [{"role": "user", "content": prompt}]
        try:
            rendered, _ = render_jinja_template([chat_], tools=tools, chat_template=template,
                                                add_generation_prompt=True, **tok.special_tokens())
        except (TypeError, KeyError) as e:  # a field the template reads, missing or mistyped
            raise ValueError(f"{where}: the chat template cannot render this record "
                             f"({type(e).__name__}: {e}); check its messages and tools") from None
        return tok.encode(rendered[0])
    if tools:
        raise ValueError(f"{where}: `tools` needs the chat template (a plain `prompt` string is "
                         f"encoded as is); give `messages` or the chat flag")
    return tok.encode(record["prompt"])


def read_prompts(path: str, tok, chat: bool, flag: str = "--grpo-prompts"
                 ) -> tuple[list[dict], list[list[int]]]:
    """(records, their token ids); ValueError naming `flag`, the file and the line otherwise."""
    records, encoded = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {path} line {n}: not JSON ({e})") from e
            if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
                raise ValueError(f"{flag} {path} line {n}: need a `prompt` (a string or "
                                 f"messages) or `messages`")
            ids = render(tok, rec, chat, f"{flag} {path} line {n}")
            if not ids:
                raise ValueError(f"{flag} {path} line {n}: the prompt encodes to no tokens")
            records.append(rec)
            encoded.append(ids)
    if not records:
        raise ValueError(f"{flag} {path}: no prompts")
    return records, encoded
