"""Chat SFT data: assistant spans from a template's generation marks and from replies located in
the rendering (the same spans), bad input counted and listed, the indexed token + mask pair,
padded and packed samples."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megazoo.data.chat import ChatRenderer, ChatTemplateError, SkipRecord
from megazoo.data.sft_dataset import SFTDataset, pack_greedily
from tests.tokenizer_data import (CHATML_PLAIN as PLAIN, CHATML_TAGGED as TAGGED, CONVERSATION,
                                  chatml_tokenizer as tokenizer)

def folder(tmp_path, template: str | None) -> str:
    path = str(tmp_path / "tok")
    tokenizer(template).save_pretrained(path)
    return path


def _spans(tok, r) -> list[str]:
    """The decoded runs of masked tokens."""
    runs, cur = [], []
    for t, m in zip(r.tokens.tolist(), r.assistant_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_generation_marks_and_rendered_prefixes_find_the_replies():
    tagged, plain = tokenizer(TAGGED), tokenizer(PLAIN)
    r = ChatRenderer(tagged).render(CONVERSATION)
    assert ChatRenderer(tagged).marks_generation and not ChatRenderer(plain).marks_generation
    assert _spans(tagged, r) == ["hello you<|im_end|>", "bye<|im_end|>"]
    p = ChatRenderer(plain).render(CONVERSATION)
    np.testing.assert_array_equal(p.tokens, r.tokens)  # the marks change no token
    np.testing.assert_array_equal(p.assistant_mask, r.assistant_mask)
    pair = ChatRenderer(tagged).render({"prompt": "hi there", "completion": "hello you"})
    assert _spans(tagged, pair) == ["hello you<|im_end|>"]


def test_bad_records_and_templates_say_why():
    r = ChatRenderer(tokenizer(TAGGED), max_tokens=12, overlong="drop")
    for record, reason in [({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
                           ({"text": "x"}, "neither"),
                           ({"messages": [{"role": "bot", "content": "x"}]}, "role 'bot'"),
                           (CONVERSATION, "over-long")]:
        with pytest.raises(SkipRecord, match=reason):
            r.render(record)
    n = len(ChatRenderer(tokenizer(TAGGED)).render(CONVERSATION).tokens) - 2
    truncating = ChatRenderer(tokenizer(TAGGED), max_tokens=n).render(CONVERSATION)
    assert truncating.truncated and len(truncating.tokens) == n and truncating.assistant_mask.any()
    unmarked = ChatRenderer(tokenizer(TAGGED.replace("'assistant' %}", "'gpt' %}")))
    with pytest.raises(SkipRecord, match="marks no generation span"):
        unmarked.render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatRenderer(tokenizer(None))


def test_preprocess_writes_tokens_and_mask_and_lists_what_it_skipped(tmp_path):
    from megazoo.tools.preprocess_sft import parse_args, preprocess
    data = tmp_path / "chat.jsonl"
    long_reply = {"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "word " * 80}]}
    lines = [json.dumps(CONVERSATION), "{not json", json.dumps({"messages": [{"role": "user", "content": "x"}]}),
             json.dumps({"prompt": "hi", "completion": "hello"}), json.dumps(long_reply)]
    data.write_text("\n".join(lines) + "\n")
    prefix = str(tmp_path / "out" / "chat")
    summary = preprocess(parse_args(["--input", str(data), "--output-prefix", prefix, "--tokenizer-model",
                                     folder(tmp_path, TAGGED), "--seq-length", "31", "--overlong", "drop"]))
    assert summary["conversations"] == 2
    assert summary["notes"] == {"bad JSON": 1, "no assistant turn": 1, "over-long": 1}
    listed = open(prefix + "_skipped.txt").read().splitlines()
    assert [s.split(": ")[0] for s in listed] == [f"{data}:{n}" for n in (2, 3, 5)]
    tok = tokenizer(TAGGED)
    padded = SFTDataset(prefix, seq_length=31, seed=0, pad_id=tok.eos_token_id)
    want = ChatRenderer(tok).render(CONVERSATION)
    samples = [padded[i] for i in range(len(padded))]
    full = next(s for s in samples if s["assistant_mask"].sum() == want.assistant_mask.sum())
    np.testing.assert_array_equal(full["tokens"][:len(want.tokens)], want.tokens)
    np.testing.assert_array_equal(full["assistant_mask"][:len(want.tokens)], want.assistant_mask)
    assert not full["assistant_mask"][len(want.tokens):].any()  # padding is never learned
    assert padded.assistant_tokens == summary["assistant_tokens"]  # no reply starts a sample
    packed = SFTDataset(prefix, seq_length=63, seed=0, pad_id=tok.eos_token_id, mode="packed")
    assert len(packed) == 1
    s = packed[0]
    starts = np.flatnonzero(np.diff(s["document_ids"])) + 1
    assert len(starts) == 2 and not s["assistant_mask"][starts].any()
    assert s["assistant_mask"].sum() == summary["assistant_tokens"]


def test_next_fit_packing_keeps_order_and_capacity():
    assert pack_greedily(np.array([5, 4, 2, 7, 1, 9]), 9) == [[0, 1], [2, 3], [4], [5]]
