"""A prompt that ends with an assistant message (a prefix meant to be continued, transformers'
`continue_final_message`), under two released templates (tests/fixtures/chat_templates/):
TRL 1.16's own SFT and DPO tokenization renders the prompt with the generation prompt, so the
prefix becomes a finished turn and the reply a second assistant turn; megazoo skips such a record
with one reason (data/chat.py `refuse_assistant_prefix`), in SFT's prompt/completion records and
in DPO's prompts alike, and still trains a conversation that ends with an assistant reply."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megazoo.data.chat import PREFIX_TO_CONTINUE, ChatRenderer, SkipRecord
from megazoo.data.preference import render_pair
from tests.fixtures import HERE, small_gpt2

# template -> (bos, eos, end of an assistant turn as rendered, generation prompt)
TEMPLATES = {
    "qwen2.5_7b_instruct": (None, "<|im_end|>", "<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama3.1_8b_instruct": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
                             "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}
CONTROL = re.compile(r"<\|[A-Za-z_]+\|>")
PROMPT = [{"role": "user", "content": "name a colour"},
          {"role": "assistant", "content": "The colour is"}]


def tokenizer(folder, name: str):
    from transformers import GPT2TokenizerFast
    bos, eos = TEMPLATES[name][:2]
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
