"""Prompt/completion records against TRL 1.16's own SFT tokenization, under released templates
(tests/fixtures/chat_templates/). A multi-turn prompt's assistant turns are context: megazoo
learns only the completion's assistant messages (data/chat.py), with the tokens and, token for
token, the mask of TRL's `SFTTrainer` (`completion_only_loss`), apart from what docs/sft.md lists
(the newline after Qwen's end-of-turn token; a completion's tool outputs and the headers around
them). A prompt that ends with an assistant message (a prefix meant to be continued,
transformers' `continue_final_message`): TRL's SFT and DPO tokenization renders the prompt with
the generation prompt, so the prefix becomes a finished turn and the reply a second assistant
turn; megazoo skips such a record with one reason (data/chat_records.py `refuse_assistant_prefix`), in
SFT's prompt/completion records and in DPO's prompts alike, refuses it in GRPO's prompts, and
still trains a conversation that ends with an assistant reply."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from megazoo.data.chat import ChatRenderer
from megazoo.data.chat_records import PREFIX_TO_CONTINUE, SkipRecord
from megazoo.data.preference import render_pair
from tests.fixtures import HERE, small_gpt2

# template -> (bos, eos, end of an assistant turn as rendered, generation prompt)
TEMPLATES = {
    "qwen2.5_7b_instruct": (None, "<|im_end|>", "<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama3.1_8b_instruct": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
                             "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}
# prompt/completion against TRL's SFT: template -> (bos, eos, what TRL learns beyond megazoo after
# a multi-turn prompt, and beyond a completion of tool call + tool output + answer: the output)
COMPLETIONS = {
    "qwen3_0.6b": (None, "<|im_end|>", "\n", "\n<|im_start|>user\n<tool_response>\nsunny, 21C\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n\n"),
    "llama3.1_8b_instruct": ("<|begin_of_text|>", "<|eot_id|>", "",
                             '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21C"<|eot_id|>'
                             "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gpt_oss_rev2": ("<|startoftext|>", "<|return|>", "", "<|start|>functions.get_weather "
                     'to=assistant<|channel|>commentary<|message|>"sunny, 21C"<|end|><|start|>assistant'),
}
# what megazoo learns of the tool completion: the call turn and the answer, each through its
# end-of-turn token (as the template renders them after the generation prompt)
TOOL_TURNS = {
    "qwen3_0.6b": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                  "<|im_end|><think>\n\n</think>\n\nIt is sunny.<|im_end|>",
    "llama3.1_8b_instruct": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
                            "It is sunny.<|eot_id|>",
    "gpt_oss_rev2": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                    "<|call|><|channel|>final<|message|>It is sunny.<|return|>",
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call00001", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL_OUTPUT = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
               "content": "sunny, 21C"}
CONTROL = re.compile(r"<\|[A-Za-z_]+\|>")
PROMPT = [{"role": "user", "content": "name a colour"},
          {"role": "assistant", "content": "The colour is"}]


def tokenizer(folder, name: str):
    from transformers import GPT2TokenizerFast
    bos, eos = (TEMPLATES.get(name) or COMPLETIONS[name])[:2]
    template = (HERE / "chat_templates" / f"{name}.jinja").read_text()
    tok = GPT2TokenizerFast(*small_gpt2(folder))
    tok.add_special_tokens({"bos_token": bos or "<|endoftext|>", "eos_token": eos,
                            "additional_special_tokens": sorted(set(CONTROL.findall(template))
                                                                - {bos, eos})})
    if bos is None:
        tok.bos_token = None
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template(request, tmp_path_factory):
    return request.param, tokenizer(tmp_path_factory.mktemp("tok"), request.param)


def test_trl_closes_the_prefix_and_megazoo_skips_the_record(template):
    import datasets
    from trl.trainer.dpo_trainer import DPOTrainer
    name, tok = template
    end_of_turn, generation_prompt = TEMPLATES[name][2:]
    record = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "blue"}],
              "rejected": [{"role": "assistant", "content": "loud"}]}
    # TRL's DPO tokenization (SFT's prompt/completion path renders the prompt the same way)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    trl = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok),
                                      datasets.Dataset.from_list([record]), tok, args, name)[0]
    # the prefix as continue_final_message leaves it open, then closed and a new turn begun
    continued = tok.apply_chat_template(PROMPT, tokenize=False, continue_final_message=True)
    assert continued.endswith("The colour is")
    assert tok.decode(trl["prompt_ids"]) == continued + end_of_turn + generation_prompt

    renderer = ChatRenderer(tok, name=name)
    with pytest.raises(SkipRecord) as dpo:
        render_pair(renderer, record)
    with pytest.raises(SkipRecord) as sft:
        renderer.render({"prompt": PROMPT, "completion": " blue"})
    assert str(dpo.value) == str(sft.value) == PREFIX_TO_CONTINUE
    assert "\n" not in PREFIX_TO_CONTINUE and "continue_final_message" in PREFIX_TO_CONTINUE
    # batched SFT rendering skips it with the same reason, and the records around it train
    ok = {"messages": PROMPT[:1] + [{"role": "assistant", "content": "The colour is blue"}]}
    out = renderer.render_batch([ok, {"prompt": PROMPT, "completion": " blue"}, ok])
    assert isinstance(out[1], SkipRecord) and str(out[1]) == PREFIX_TO_CONTINUE
    for rendered in (out[0], out[2]):  # a conversation that ends with a reply learns it
        text = tok.decode([t for t, m in zip(rendered.tokens, rendered.assistant_mask) if m])
        assert text == "The colour is blue" + TEMPLATES[name][1], text
    # a prompt whose assistant turn is followed by a user turn is still a prompt
    later = PROMPT + [{"role": "user", "content": "go on"}]
    chosen, _ = render_pair(renderer, {**record, "prompt": later})
    assert tok.decode([t for t, m in zip(chosen.tokens, chosen.assistant_mask) if m]) == \
        "blue" + TEMPLATES[name][1]


def reply(name: str, thought: str, answer: str) -> dict:
    """An assistant turn with reasoning where the template takes it (Qwen3 inline, gpt-oss's
    `thinking`; Qwen3 and gpt-oss drop it from turns before the last user turn)."""
    if name.startswith("qwen3"):
        return {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}
    return {"role": "assistant", "content": answer,
            **({"thinking": thought} if name.startswith("gpt_oss") else {})}


def trl_sft(tok, name: str, records: list[dict]):
    """TRL 1.16's own SFT tokenization (`SFTTrainer._prepare_dataset`, called without a model,
    `completion_only_loss` on as SFTTrainer sets it for prompt/completion data): the ids and
    whether each token is learned (its label kept)."""
    import datasets
    from trl.trainer.sft_trainer import SFTTrainer
    args = SimpleNamespace(dataset_num_proc=None, dataset_text_field="text", max_length=None,
                           assistant_only_loss=False, shuffle_dataset=False)
    owner = SimpleNamespace(_tokenizer=tok, completion_only_loss=True, chat_template=None)
    out = SFTTrainer._prepare_dataset(owner, datasets.Dataset.from_list(records), tok, args,
                                      False, None, name)
    return [(row["input_ids"], [int(label != -100) for label in row["labels"]]) for row in out]


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
def test_prompt_completion_learns_the_completion_as_trl_sft(tmp_path_factory, name):
    """A multi-turn prompt (its assistant turns with reasoning where the template takes it) and a
    completion: the tokens are TRL's, the mask TRL's completion mask less `COMPLETIONS`' extra;
    the prompt's assistant turns are not learned (the bug: they were). A completion of a tool
    call, its output and the answer learns the two assistant turns; TRL also the output."""
    tok = tokenizer(tmp_path_factory.mktemp("tok"), name)
    eos, extra_prompt, extra_tools = COMPLETIONS[name][1:]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
            reply(name, "step one", "hello you"), {"role": "user", "content": "how are things"},
            reply(name, "step two", "fine thanks"), {"role": "user", "content": "and now"}]
    records = [{"prompt": chat[:n], "completion": [reply(name, "step three", "bye now")]}
               for n in (4, 6)]
    answer = {"role": "assistant", "content": "It is sunny."}
    tooled = [{"prompt": chat[:2], "completion": [CALL, TOOL_OUTPUT, answer],
               "tools": json.dumps(TOOLS)}]  # TRL takes JSON text
    renderer = ChatRenderer(tok, name=name)
    for group, extra in ((records, extra_prompt), (tooled, extra_tools)):
        for record, (ids, learned), batched in zip(group, trl_sft(tok, name, group),
                                                   renderer.render_batch(group)):
            ours = renderer.render(record)
            what = (name, len(record["prompt"]), len(record["completion"]))
            assert ours.tokens.tolist() == ids == batched.tokens.tolist(), what
            mask = ours.assistant_mask.tolist()
            assert mask == batched.assistant_mask.tolist(), what
            assert all(t for m, t in zip(mask, learned) if m), what  # TRL learns all we learn
            assert tok.decode([i for i, m, t in zip(ids, mask, learned) if t and not m]) == \
                extra, what
            text = tok.decode([i for i, m in zip(ids, mask) if m])
            if record in tooled:
                assert text == TOOL_TURNS[name], what
            else:
                assert text.endswith("bye now" + eos) and "hello" not in text \
                    and "fine" not in text, what
    # the same conversation as `messages` learns every assistant turn, the earlier ones too
    whole = renderer.render({"messages": records[1]["prompt"] + records[1]["completion"]})
    text = tok.decode(whole.tokens[whole.assistant_mask == 1].tolist())
    assert "hello you" in text and "fine thanks" in text and text.endswith("bye now" + eos)
    with pytest.raises(SkipRecord, match="'completion' has no assistant message"):
        renderer.render({"prompt": chat[:2], "completion": [TOOL_OUTPUT]})


def test_grpo_refuses_a_prompt_that_ends_with_an_assistant_message(tmp_path):
    """GRPO's prompts (training/run/grpo_prompts.py): TRL 1.16's GRPOTrainer renders a chat
    prompt with `add_generation_prompt=True` whatever its last message, closing an assistant
    prefix and sampling a second assistant turn; megazoo refuses it in one line, as SFT and DPO
    skip it. A `prompt` given as a list of messages (TRL's conversational prompt) is a chat."""
    from megazoo.data.tokenizers import HFTokenizer
    from megazoo.training.run.grpo_prompts import render
    tok = tokenizer(tmp_path, "qwen2.5_7b_instruct")
    tok.save_pretrained(tmp_path / "tok")
    loaded = HFTokenizer(str(tmp_path / "tok"))
    closed = tok.apply_chat_template([PROMPT], add_generation_prompt=True, tokenize=False)[0]
    assert closed.endswith("The colour is<|im_end|>\n<|im_start|>assistant\n")  # TRL's context
    for record in ({"messages": PROMPT}, {"prompt": PROMPT}):
        with pytest.raises(ValueError, match=r"^p.jsonl line 3: the chat ends with an assistant "
                                             r"message, a prefix to continue.*GRPOTrainer"):
            render(loaded, record, False, "p.jsonl line 3")
    want = tok.apply_chat_template(PROMPT[:1], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert render(loaded, {"prompt": PROMPT[:1]}, False, "p") == list(want)
    with pytest.raises(ValueError, match="`prompt` is neither a string nor a list of messages"):
        render(loaded, {"prompt": 3}, False, "p")


def test_grpo_conversational_prompts_are_checked_as_chat_sft_checks_them(tmp_path):
    """A `prompt` list or `messages` goes through data/chat_records.py `check_messages` (as
    chat SFT's conversation_of): an empty chat, a non-message, a message without content, a
    dict for a list are each refused in one line naming the file and line; `messages` is the
    chat whenever present; a template that cannot render a record says so in one line."""
    from megazoo.data.chat_records import check_messages, conversation_of
    from megazoo.training.run.grpo_prompts import read_prompts, render

    class Tok:
        chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")

        def special_tokens(self):
            return {}

        def encode(self, text):
            return [ord(c) for c in text]
    user = {"role": "user", "content": "a"}
    for record, reason in [({"prompt": []}, "`prompt`: messages is an empty list"),
                           ({"prompt": ["hello"]}, "`prompt`: messages is not a list of"),
                           ({"prompt": [{"role": "user"}]}, "`prompt`: a message with role 'user' "
                                                            "and no string content"),
                           ({"messages": [], "prompt": "x"}, "`messages`: messages is an empty list"),
                           ({"messages": user}, "`messages`: messages is not a list of"),
                           ({"messages": "hi"}, "`messages`: messages is not a list of"),
                           ({"messages": None}, "`messages`: messages is not a list of")]:
        with pytest.raises(ValueError, match="^p.jsonl line 2: " + re.escape(reason)):
            render(Tok(), record, False, "p.jsonl line 2")
    assert render(Tok(), {"messages": [user], "prompt": "x"}, False, "p") == \
        Tok().encode("<user>a<assistant>")
    with pytest.raises(SkipRecord, match="messages is an empty list"):
        conversation_of({"messages": []})
    check_messages([user])
    broken = Tok()
    broken.chat_template = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(ValueError, match=r"^p line 1: the chat template cannot render this record "
                                         r"\(TypeError: "):
        render(broken, {"messages": [user]}, False, "p line 1")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": ["hello"]}) + "\n")
    with pytest.raises(ValueError) as e:
        read_prompts(str(path), Tok(), False)
    assert str(e.value).startswith(f"--grpo-prompts {path} line 2: `prompt`: messages is not a list")
    assert len(str(e.value).splitlines()) == 1
