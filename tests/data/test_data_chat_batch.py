"""Chat rendering in batches (what tools/preprocess_sft.py's workers do): every record gets the
tokens, mask, truncation flag or skip reason that rendering it alone gives, whatever its
neighbours in the batch, with generation marks and with located replies (a prompt/completion
record learns only its completion); and the tool writes the same files with 1 and 2 workers."""
from __future__ import annotations

import json

import numpy as np

from megazoo.data.chat import ChatRenderer, SkipRecord
from tests.tokenizer_data import CHATML_PLAIN, CHATML_TAGGED, CONVERSATION, chatml_tokenizer

LONG = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 40}]}
RECORDS = [CONVERSATION, {"text": "x"}, {"prompt": "hi", "completion": "hello"},
           {"messages": [{"role": "user", "content": "only a question"}]}, LONG,
           {"messages": [{"role": "user", "content": "naïve <|im_end|> café"},
                         {"role": "assistant", "content": "日本語 😀\n\n  spaced\ttabs"}]},
           {"messages": [{"role": "bot", "content": "x"}]}, CONVERSATION,
           # a multi-turn prompt: its assistant turn is context, rendered per record under marks
           {"prompt": CONVERSATION["messages"][:4], "completion": CONVERSATION["messages"][4:]}]


def _same(alone, batched) -> str:
    if isinstance(alone, SkipRecord):
        assert isinstance(batched, SkipRecord) and str(batched) == str(alone)
        return "skip"
    np.testing.assert_array_equal(batched.tokens, alone.tokens)
    np.testing.assert_array_equal(batched.assistant_mask, alone.assistant_mask)
    assert batched.tokens.dtype == alone.tokens.dtype and batched.assistant_mask.dtype == alone.assistant_mask.dtype
    assert batched.truncated == alone.truncated
    return "truncated" if alone.truncated else "kept"


def _alone(renderer, record):
    try:
        return renderer.render(record)
    except SkipRecord as e:
        return e


def test_batch_renders_each_record_as_alone():
    seen = []
    for template in (CHATML_TAGGED, CHATML_PLAIN):
        tok = chatml_tokenizer(template)
        for kw in ({}, {"max_tokens": 20}, {"max_tokens": 20, "overlong": "drop"}):
            renderer = ChatRenderer(tok, **kw)
            batched = renderer.render_batch(RECORDS)
            assert len(batched) == len(RECORDS)
            seen += [_same(_alone(renderer, r), b) for r, b in zip(RECORDS, batched)]
            if not kw:  # the prompt/completion record learns "bye", not the prompt's "hello you"
                learned = batched[-1].tokens[batched[-1].assistant_mask == 1].tolist()
                assert tok.decode(learned) == "bye<|im_end|>"
    # every outcome occurs, so the comparison covers kept, truncated and skipped records
    assert {"skip", "truncated", "kept"} <= set(seen) and len(seen) == 6 * len(RECORDS)
    tok.chat_template = CHATML_TAGGED.replace("'assistant' %}", "'gpt' %}")
    assert all(isinstance(r, SkipRecord) for r in ChatRenderer(tok).render_batch(RECORDS))
    assert ChatRenderer(tok).render_batch([]) == []


def test_preprocess_sft_workers_write_identical_files(tmp_path, monkeypatch):
    from megazoo.tools import preprocess_sft
    from megazoo.tools.preprocess_sft import parse_args, preprocess
    monkeypatch.setattr(preprocess_sft, "BATCH_LINES", 5)  # several batches for the workers
    folder = str(tmp_path / "tok")
    chatml_tokenizer(CHATML_TAGGED).save_pretrained(folder)
    data = tmp_path / "chat.jsonl"
    lines = [json.dumps(RECORDS[i % len(RECORDS)]) for i in range(3 * len(RECORDS))] + ["{bad"]
    data.write_text("\n".join(lines) + "\n")
    outs = []
    for w in (1, 2):
        prefix = str(tmp_path / f"w{w}" / "chat")
        summary = preprocess(parse_args(["--input", str(data), "--output-prefix", prefix, "--tokenizer-model",
                                         folder, "--seq-length", "19", "--workers", str(w)]))
        outs.append((summary, [open(f"{prefix}_{k}_document.{e}", "rb").read()
                               for k in ("text", "assistant_mask") for e in ("bin", "idx")],
                     open(prefix + "_skipped.txt").read()))
    (s1, files1, skipped1), (s2, files2, skipped2) = outs
    assert s1["conversations"] > 0 and s1["notes"]["truncated"] > 0 and s1["notes"]["bad JSON"] == 1
    assert {k: v for k, v in s1.items() if k != "listed_in"} == {k: v for k, v in s2.items() if k != "listed_in"}
    assert files1 == files2 and skipped1 == skipped2
