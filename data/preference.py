"""Preference pairs for DPO: records rendered with the chat template, stored as chat sets, and
read in pairs.

A record is ``{"prompt", "chosen", "rejected"}``, each a string or a list of messages (a string
prompt is one user turn, a string reply one assistant turn), and optionally ``"tools"`` (tool
schemas for the template, as in SFT; replies may be tool calls). Each reply is rendered after the
prompt as one conversation (`ChatRenderer.render` with the prompt as context): the tokens are
`apply_chat_template(prompt + reply)`, what the model sees at inference, and the mask (1) is the
reply's assistant messages located in that rendering plus their end-of-turn tokens, exactly as
SFT masks a reply (data/chat.py, data/chat_spans.py), with SFT's fallback and skip reasons.
Assistant turns inside a multi-turn prompt are context, not learned; a prompt that ends with
an assistant message (a prefix to continue) is skipped with the reason (data/chat_records.py
`refuse_assistant_prefix`). docs/post_training.md says
where this differs from TRL's DPOTrainer.

On disk a preference set is a chat set (data/sft_dataset.py's two indexed files) whose
documents alternate chosen, rejected (document 2i and 2i + 1 are pair i), plus
``<prefix>_preference.json`` that says so. `split_preference_datasets` cuts the pairs by --split
and orders samples pair by pair (shuffled by pair), so a microbatch of an even size holds whole
pairs: sample 2j is a pair's chosen sequence and 2j + 1 its rejected one.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from .chat import ChatRenderer, Rendered
from .chat_records import SkipRecord, refuse_assistant_prefix, refuse_template_kwargs
from .gpt_dataset import parse_split, split_boundaries
from .indexed import IndexedDatasetError
from .sft_dataset import SFTDataset, open_pair

logger = logging.getLogger(__name__)


def marker_path(prefix: str) -> str:
    return prefix + "_preference.json"


def _messages(value, role: str, what: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise SkipRecord(f"'{what}' is neither a string nor a list of messages")


def render_pair(renderer: ChatRenderer, record: dict) -> tuple[Rendered, Rendered]:
    """(chosen, rejected) sequences of one record, each with its reply mask; see the docstring."""
    if not all(k in record for k in ("prompt", "chosen", "rejected")):
        raise SkipRecord("not a preference record (prompt, chosen, rejected)")
    refuse_template_kwargs(record)
    prompt = _messages(record["prompt"], "user", "prompt")
    refuse_assistant_prefix(prompt)
    replies = [_messages(record[key], "assistant", key) for key in ("chosen", "rejected")]
    for key, reply in zip(("chosen", "rejected"), replies):
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in reply):
            raise SkipRecord(f"'{key}' has no assistant message")
    tools = {"tools": record["tools"]} if record.get("tools") is not None else {}
    chosen, rejected = (renderer.render({"messages": prompt + reply, **tools}, context=len(prompt))
                        for reply in replies)
    return chosen, rejected


def split_preference_datasets(prefix: str, split: str, seq_length: int, seed: int, *,
                              pad_id: int) -> list[SFTDataset | None]:
    """Train/valid/test datasets of the pairs --split cuts (in file order), samples ordered
    pair by pair (see the module docstring); None for a split without pairs."""
    if not os.path.isfile(marker_path(prefix)):
        raise IndexedDatasetError(f"--data-path {prefix}: not a preference set ({marker_path(prefix)} "
                                  f"is missing); preprocess it with tools/preprocess_dpo.py")
    pair = open_pair(prefix)
    if len(pair[0]) % 2:
        raise IndexedDatasetError(f"{prefix}: {len(pair[0])} sequences, not whole pairs; "
                                  f"preprocess the set again")
    pairs = len(pair[0]) // 2
    bounds = split_boundaries(parse_split(split), pairs)
    out = []
    for i in range(3):
        lo, hi = bounds[i], bounds[i + 1]
        if hi <= lo:
            out.append(None)
            continue
        ds = SFTDataset(prefix, seq_length, seed, pad_id=pad_id, pair=pair,
                        documents=np.arange(2 * lo, 2 * hi))
        order = lo + np.random.default_rng(seed).permutation(hi - lo)
        ds.samples = [[int(2 * p + k)] for p in order for k in (0, 1)]
        out.append(ds)
    logger.info("%s (--split %s): %s", prefix, split, ", ".join(
        f"{name} {bounds[i + 1] - bounds[i]} pairs" for i, name in enumerate(("train", "valid", "test"))))
    return out


def write_marker(prefix: str, summary: dict) -> None:
    with open(marker_path(prefix), "w") as f:
        json.dump({"kind": "preference pairs", **summary}, f, indent=1)
