"""Tool-calling conversations through the released chat templates of tests/fixtures/chat_templates/
(ChatRenderer, data/chat.py; docs/sft.md "Tool calls"): a record with `tools`, a system prompt, a
user turn, an assistant turn that calls a tool, the tool's output and the final answer. The tokens
are transformers' `apply_chat_template(messages, tools=tools)` of the whole record, and the mask
is exactly the two assistant turns as that rendering shows them plus their end-of-turn tokens,
written out per template below from reading it (not from the code under test) and found in the
rendered text by search. Also DPO's pairs with tools (the prompt's tool call and tool output not
learned) and TRL's DPO tokenization of them, the templates that cannot render tool calls (the
record is skipped with the reason), and malformed records."""
from __future__ import annotations

import json

import pytest

from megazoo.data.chat import ChatRenderer, SkipRecord
from megazoo.data.preference import render_pair
from tests.data.test_data_chat_templates import (expected_mask, same_mask, tokenizer,
                                                 trl_dpo_pairs)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ARGS = {"city": "Paris"}
CALL_ID = "call00001"  # Mistral's templates want 9 characters
ANSWER = "It is sunny."
DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
QWEN_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             "<|im_end|>")
HARMONY_CALL = (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                "<|call|>")
MISTRAL_JSON = '[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]'
QWEN3_FINAL = f"<think>\n\n</think>\n\n{ANSWER}<|im_end|>"
# template -> (tool-call arguments as a JSON string (DeepSeek) or a dict, the tool-call turn and
# the final answer as the template renders them, from after its generation prompt through the
# end-of-turn token)
SUPPORTED = {
    "llama3.1_8b_instruct": (False, '{"name": "get_weather", "parameters": {"city": "Paris"}}'
                                    "<|eot_id|>", ANSWER + "<|eot_id|>"),
    "llama3.2_3b_instruct": (False, '{"name": "get_weather", "parameters": {"city": "Paris"}}'
                                    "<|eot_id|>", ANSWER + "<|eot_id|>"),
    "qwen2.5_7b_instruct": (False, QWEN_CALL, ANSWER + "<|im_end|>"),
    "qwen3_0.6b": (False, QWEN_CALL, QWEN3_FINAL),  # the last turn always gets a think block
    "qwen3_rev2": (False, QWEN_CALL, QWEN3_FINAL),
    "mistral_7b_instruct_v0.3": (False, f" [TOOL_CALLS] {MISTRAL_JSON} </s>", f" {ANSWER} </s>"),
    "mistral_nemo_instruct_2407": (False, f"[TOOL_CALLS]{MISTRAL_JSON}</s>", ANSWER + "</s>"),
    "mistral_small_3.2_24b_instruct_2506": (
        False, '[TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{"city": "Paris"}</s>',
        ANSWER + "</s>"),
    # llama.cpp's copy prompts <|start|>assistant<|channel|>final<|message|>: the call starts
    # where that prompt stops agreeing with the rendering
    "gpt_oss_120b": (False, HARMONY_CALL, ANSWER + "<|return|>"),
    "gpt_oss_rev2": (False, HARMONY_CALL, f"<|channel|>final<|message|>{ANSWER}<|return|>"),
    "deepseek_v3_rev2": (True, DS_CALL, ANSWER + "<｜end▁of▁sentence｜>"),  # after
    "deepseek_r1": (True, DS_CALL, ANSWER + "<｜end▁of▁sentence｜>"),  # <｜tool▁outputs▁end｜>
    "deepseek_r1_0528_qwen3_8b": (True, DS_CALL, ANSWER + "<｜end▁of▁sentence｜>"),
}
# with reasoning on both turns (Qwen3's reasoning_content, gpt-oss's thinking): Qwen3 keeps the
# reasoning of every turn after the last user query (tool outputs are not one); gpt-oss drops the
# tool-call turn's analysis once a final answer follows
REASONING = {
    "qwen3_0.6b": ("reasoning_content", "<think>\nneed weather\n</think>\n\n" + QWEN_CALL,
                   f"<think>\nit said sunny\n</think>\n\n{ANSWER}<|im_end|>"),
    "gpt_oss_120b": ("thinking", HARMONY_CALL, "analysis<|message|>it said sunny<|end|><|start|>"
                     f"assistant<|channel|>final<|message|>{ANSWER}<|return|>"),
    "gpt_oss_rev2": ("thinking", HARMONY_CALL, "<|channel|>analysis<|message|>it said sunny<|end|>"
                     f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"),
}
REASONING["qwen3_rev2"] = REASONING["qwen3_0.6b"]
# the tool-call turn as the last message (a DPO reply): Qwen3 gives the last turn a think block
LAST_CALL = {n: "<think>\n\n</think>\n\n" + QWEN_CALL for n in ("qwen3_0.6b", "qwen3_rev2")}


def call_turn(json_args: bool, content="", **extra) -> dict:
    arguments = json.dumps(ARGS) if json_args else ARGS
    return {"role": "assistant", "content": content, **extra, "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]}


def conversation(json_args: bool, reasoning: str | None = None) -> list[dict]:
    """System, user, a tool call, its output, the answer; `reasoning`: the field that carries
    both assistant turns' reasoning."""
    think = ({reasoning: "need weather"}, {reasoning: "it said sunny"}) if reasoning else ({}, {})
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Paris?"},
            call_turn(json_args, **think[0]),
            {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
             "content": "sunny, 21C"},
            {"role": "assistant", "content": ANSWER, **think[1]}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tok")


def check_record(tok, renderer, name, messages, replies, what) -> None:
    r = renderer.render({"messages": messages, "tools": TOOLS})
    want = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True)
    assert r.tokens.tolist() == list(want["input_ids"]), what
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    same_mask(tok, r.tokens, r.assistant_mask, expected_mask(tok, text, replies), what)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_tool_calling_conversation_learns_the_call_and_the_answer(folder, name):
    """SFT: the record (and with reasoning where the template carries it); DPO: a tool call
    chosen over a plain reply after the user turn, and an answer after the prompt's tool call
    and output: only the final reply learned."""
    tok = tokenizer(folder, name)
    renderer = ChatRenderer(tok, name=name)
    json_args, call, final = SUPPORTED[name]
    check_record(tok, renderer, name, conversation(json_args), [call, final], name)
    if name in REASONING:
        field, call_r, final_r = REASONING[name]
        check_record(tok, renderer, name, conversation(json_args, field), [call_r, final_r],
                     f"{name} ({field})")
    messages = conversation(json_args)
    for prompt, chosen, rejected, reply in [
            (messages[:2], [messages[2]], "no idea", LAST_CALL.get(name, call)),
            (messages[:4], [messages[4]], "no idea", final)]:
        pair = render_pair(renderer, {"prompt": prompt, "chosen": chosen, "rejected": rejected,
                                      "tools": TOOLS})
        full = tok.apply_chat_template(prompt + chosen, tools=TOOLS, tokenize=False)
        want = tok.apply_chat_template(prompt + chosen, tools=TOOLS, tokenize=True,
                                       return_dict=True)["input_ids"]
        assert pair[0].tokens.tolist() == list(want), (name, len(prompt))
        same_mask(tok, pair[0].tokens, pair[0].assistant_mask, expected_mask(tok, full, [reply]),
                  f"{name} pair after {len(prompt)} messages")
        learned = tok.decode(pair[1].tokens[pair[1].assistant_mask == 1].tolist())
        assert "no idea" in learned and "sunny, 21C" not in learned, (name, learned)
    check_grpo_prompt(tok, name, folder, messages[:4])


def check_grpo_prompt(tok, name, folder, prompt) -> None:
    """GRPO's prompt tokens (training/run/grpo_prompts.py, the tokenizer folder as the trainer
    loads it) with the record's tools: apply_chat_template(prompt, tools, generation prompt)."""
    from megazoo.data.tokenizers import HFTokenizer
    from megazoo.training.run.grpo_prompts import render
    tok.save_pretrained(folder / f"{name}_grpo")
    loaded = HFTokenizer(str(folder / f"{name}_grpo"))
    want = tok.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert render(loaded, {"messages": prompt, "tools": TOOLS}, True, name) == list(want), name
    for tools in (TOOLS, json.dumps(TOOLS)):
        with pytest.raises(ValueError, match="needs the chat template"):
            render(loaded, {"prompt": "hi", "tools": tools}, False, name)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        render(loaded, {"messages": prompt, "chat_template_kwargs": {"enable_thinking": False}},
               True, name)


def test_trl_dpo_tokenizes_tool_records_to_the_same_tokens(folder):
    """TRL 1.16's DPO tokenization (`DPOTrainer._prepare_dataset`, the record's `tools` passed
    to the template) of the pairs above gives megazoo's tokens under every tool template, and
    learns at least what megazoo learns (docs/post_training.md says what more)."""
    for name in sorted(SUPPORTED):
        tok = tokenizer(folder, name)
        messages = conversation(SUPPORTED[name][0])
        records = [{"prompt": messages[:n], "chosen": [messages[n]],
                    "rejected": [{"role": "assistant", "content": "no idea"}],
                    "tools": json.dumps(TOOLS)} for n in (2, 4)]  # TRL takes JSON text too
        for record, key, trl, ours in trl_dpo_pairs(tok, name, records):
            assert not any(ours.assistant_mask[:len(trl["prompt_ids"])]), \
                (name, len(record["prompt"]), key)


# templates that cannot render a tool call: they ignore tool_calls (the turn would be an empty
# reply), refuse the tool role, or (DeepSeek-V3's first revision and R1-Distill: a tool call
# only when content is None, a key transformers drops) fail on it
IGNORE = ("smollm2_135m_instruct", "smollm3_3b", "phi3_mini_instruct", "phi3.5_mini_instruct",
          "phi4", "deepseek_v3", "deepseek_r1_distill")


def test_templates_without_tool_calls_skip_the_record_with_the_reason(folder, caplog):
    ignored = "renders nothing of an assistant turn's tool_calls"
    for name in IGNORE:
        renderer = ChatRenderer(tokenizer(folder, name), name=name)
        record = {"messages": conversation(name.startswith("deepseek")), "tools": TOOLS}
        with pytest.raises(SkipRecord, match=ignored):
            renderer.render(record)
        if name.startswith("deepseek"):  # content None: the template's own error
            record["messages"][2] = call_turn(True, content=None)
            with pytest.raises(SkipRecord, match="'dict object' has no attribute 'content'"):
                renderer.render(record)
    with pytest.raises(SkipRecord, match="refuses the conversation: Conversation roles must"):
        ChatRenderer(tokenizer(folder, "gemma3_it")).render({"messages": conversation(False)})
    # DeepSeek's dict arguments: the template's TypeError, with the fix
    with pytest.raises(SkipRecord, match="fails on the record: can only concatenate.*JSON string"):
        ChatRenderer(tokenizer(folder, "deepseek_r1")).render({"messages": conversation(False)})
    # DeepSeek's templates render nothing of `tools`: logged once, the record kept
    caplog.set_level("WARNING", logger="megazoo.data.chat")
    r1 = ChatRenderer(tokenizer(folder, "deepseek_r1"), name="r1")
    for _ in range(2):
        r1.render({"messages": conversation(True), "tools": TOOLS})
    assert sum("renders nothing of the records' 'tools'" in r.getMessage()
               for r in caplog.records) == 1


def test_malformed_tool_records_and_unmarkable_calls(folder, caplog):
    renderer = ChatRenderer(tokenizer(folder, "qwen2.5_7b_instruct"))
    good = conversation(False)
    bad = {"tool_calls on a user": [good[1] | {"tool_calls": good[2]["tool_calls"]}] + good[2:],
           "content None without": [good[1], {"role": "assistant", "content": None}],
           "an empty tool_calls": [good[1], {**good[2], "tool_calls": []}]}
    for what, messages in bad.items():
        with pytest.raises(SkipRecord, match="tool_calls|no string content"):
            renderer.render({"messages": messages})
    for tools in ("not json", {"a": 1}):
        with pytest.raises(SkipRecord, match="'tools'"):
            renderer.render({"messages": good, "tools": tools})
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}  # TRL's; not applied: refused
    with pytest.raises(SkipRecord, match="chat_template_kwargs"):
        renderer.render({"messages": good, **kwargs})
    with pytest.raises(SkipRecord, match="chat_template_kwargs"):
        render_pair(renderer, {"prompt": good[:2], "chosen": [good[2]], "rejected": "no", **kwargs})
    # tools as JSON text (as TRL takes them) render as the list; a missing content key is None
    text = renderer.render({"messages": good, "tools": json.dumps(TOOLS)})
    missing = [m if m is not good[2] else {k: v for k, v in m.items() if k != "content"}
               for m in good]
    same = renderer.render({"messages": missing, "tools": TOOLS})
    assert text.tokens.tolist() == same.tokens.tolist()
    assert text.assistant_mask.tolist() == same.assistant_mask.tolist()
    assert renderer.render_batch([{"messages": good, "tools": TOOLS}])[0].tokens.tolist() == \
        text.tokens.tolist()
    # arguments without a string value cannot be marked: the prefix renderings (exact here),
    # logged
    caplog.set_level("WARNING", logger="megazoo.data.chat")
    tok = tokenizer(folder, "llama3.1_8b_instruct")
    numbers = [m if m is not good[2] else {**m, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"days": 3}}}]}
        for m in good]
    r = ChatRenderer(tok, name="llama").render({"messages": numbers, "tools": TOOLS})
    text = tok.apply_chat_template(numbers, tools=TOOLS, tokenize=False)
    call = '{"name": "get_weather", "parameters": {"days": 3}}<|eot_id|>'
    same_mask(tok, r.tokens, r.assistant_mask,
              expected_mask(tok, text, [call, ANSWER + "<|eot_id|>"]), "unmarkable")
    assert any("no string value" in x.getMessage() and "prefix renderings" in x.getMessage()
               for x in caplog.records)
    # ... and a template that ignores such calls still skips the record
    with pytest.raises(SkipRecord, match="renders nothing of an assistant turn's tool_calls"):
        ChatRenderer(tokenizer(folder, "smollm2_135m_instruct")).render({"messages": numbers})
