"""Chat records: what a record holds (`messages`, or `prompt` + `completion`; `tools`), checked,
and the records that cannot train, each skipped with one reason (`SkipRecord`). Rendering them is
data/chat.py's; DPO's pairs (data/preference.py) and GRPO's prompts (training/run/grpo_prompts.py)
use the same checks."""
from __future__ import annotations

import json

ROLES = ("system", "user", "assistant", "tool")


class SkipRecord(ValueError):
    """A record that cannot be trained on; the message is the reason (counted per reason)."""


def conversation_of(record: dict) -> tuple[list[dict], int]:
    """The messages of a record (messages, or prompt + completion), checked for roles and content,
    and how many of them are context only: none of a `messages` record, the prompt's of a
    prompt/completion pair (only the completion's assistant messages are learned)."""
    refuse_template_kwargs(record)
    context = 0
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                      else completion)
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise SkipRecord("'prompt' or 'completion' is neither a string nor a list of messages")
        refuse_assistant_prefix(prompt)
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            raise SkipRecord("'completion' has no assistant message (the prompt's assistant "
                             "turns are context, not learned)")
        messages, context = list(prompt) + list(completion), len(prompt)
    else:
        raise SkipRecord("neither 'messages' nor 'prompt' + 'completion'")
    check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRecord("no assistant turn")
    return messages, context


def check_messages(messages) -> None:
    """A non-empty list of {role, content} objects, each role known and each content a string
    (None only beside an assistant's `tool_calls`); SkipRecord with the reason otherwise."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SkipRecord("messages is not a list of {role, content} objects")
    if not messages:
        raise SkipRecord("messages is an empty list")
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None and (m.get("role") != "assistant" or not isinstance(calls, list)
                                  or not calls or not all(isinstance(c, dict) for c in calls)):
            raise SkipRecord(f"a message with role {m.get('role')!r} and 'tool_calls' that are not "
                             f"an assistant's non-empty list of {{function: {{name, arguments}}}}")
        if m.get("role") not in ROLES or not (isinstance(m.get("content"), str)
                                              or calls and m.get("content") is None):
            raise SkipRecord(f"a message with role {m.get('role')!r} and no string content "
                             f"(roles: {', '.join(ROLES)}; content may be None only beside "
                             f"tool_calls)")


def refuse_template_kwargs(record: dict) -> None:
    """A record's own template arguments (TRL's `chat_template_kwargs`, e.g. enable_thinking)
    are not applied: such a record is skipped with the reason rather than rendered otherwise."""
    if record.get("chat_template_kwargs"):
        raise SkipRecord("'chat_template_kwargs' (per-record template arguments) are not applied; "
                         "drop the field to render with the template's defaults")


PREFIX_TO_CONTINUE = (
    "'prompt' ends with an assistant message, a prefix to continue (transformers' "
    "continue_final_message), which TRL 1.16 renders as a finished turn followed by a second "
    "assistant turn; move that text into the reply, or end the prompt with a user or tool message")


def refuse_assistant_prefix(prompt) -> None:
    """A prompt (SFT's prompt/completion, DPO's prompt) whose last message is the assistant's is
    skipped with the reason: the reply would have to continue that message, and TRL 1.16's
    SFT and DPO tokenization (the prompt with `add_generation_prompt=True`, then prompt + reply)
    instead closes it and starts another assistant turn, a context no inference call gives."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) \
            and prompt[-1].get("role") == "assistant":
        raise SkipRecord(PREFIX_TO_CONTINUE)


def tools_of(record: dict) -> list | None:
    """The record's tool schemas (a list, or its JSON text, as TRL accepts), or None."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise SkipRecord("'tools' is a string that is not JSON") from None
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise SkipRecord("'tools' is not a list of JSON schema objects")
    return tools or None
