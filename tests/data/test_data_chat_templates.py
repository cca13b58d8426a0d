"""Released chat templates (tests/fixtures/chat_templates/, copied unchanged; sources in
tests/fixtures/README.md) through ChatRenderer: the tokens are transformers'
`apply_chat_template` of the whole conversation, and the mask is exactly each assistant reply as
that rendering shows it plus its end-of-turn token. The expected replies are written out per
template from reading it (Qwen3 drops the reasoning of turns before the last user turn, the
DeepSeek-R1 family drops all of it, gpt-oss keeps only the last turn's analysis channel) and
located in the rendered text by search; the expected mask is the tokens overlapping them (the
tokenizer's offsets). Each template's tokenizer is the 301-token byte-level BPE of
tests/fixtures with the template's control tokens added as special tokens; the Mistral and Gemma
templates run over a SentencePiece BPE too. Under each template also DPO's preference pairs
(data/preference.py) after a 1-turn and a 2-turn prompt, only the final reply learned; GRPO's
prompt tokens (training/run/grpo_prompts.py) against `apply_chat_template(...,
add_generation_prompt=True)`; and TRL's own DPO tokenization of the same pairs. Then: templates
that refuse a conversation, drop a message, or mark more than the replies, and the fallbacks
when a reply cannot be located (DPO's pairs included)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megazoo.data.chat import ChatRenderer, SkipRecord
from megazoo.data.preference import render_pair
from tests.fixtures import HERE, small_gpt2

TEMPLATES = HERE / "chat_templates"
CONTROL = re.compile(r"<\|[A-Za-z_]+\|>|<｜[^｜<>]+｜>|\[/?[A-Z_]+\]|<(?:start|end)_of_turn>")

DS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
LLAMA = ("<|begin_of_text|>", "<|eot_id|>")
MISTRAL = ("<s>", "</s>")
CHATML = (None, "<|im_end|>")
# template file -> (bos, eos, how it renders an assistant turn (below), end-of-turn token)
CASES = {
    "llama3.1_8b_instruct": (*LLAMA, "as-is", "<|eot_id|>"),
    "llama3.2_3b_instruct": (*LLAMA, "as-is", "<|eot_id|>"),
    "qwen2.5_7b_instruct": (*CHATML, "as-is", "<|im_end|>"),
    "qwen3_0.6b": (*CHATML, "qwen3", "<|im_end|>"),
    "qwen3_rev2": (*CHATML, "qwen3", "<|im_end|>"),
    "smollm2_135m_instruct": (*CHATML, "as-is", "<|im_end|>"),
    "smollm3_3b": (*CHATML, "as-is", "<|im_end|>"),
    "mistral_7b_instruct_v0.3": (*MISTRAL, "spaced", "</s>"),
    "mistral_nemo_instruct_2407": (*MISTRAL, "as-is", "</s>"),
    "mistral_small_3.2_24b_instruct_2506": (*MISTRAL, "as-is", "</s>"),
    "gemma3_it": ("<bos>", "<eos>", "as-is", "<end_of_turn>"),
    "deepseek_v3": (*DS, "as-is", DS[1]),
    "deepseek_v3_rev2": (*DS, "r1", DS[1]),
    "deepseek_r1": (*DS, "r1", DS[1]),
    "deepseek_r1_distill": (*DS, "r1", DS[1]),
    "deepseek_r1_0528_qwen3_8b": (*DS, "r1", DS[1]),
    "gpt_oss_120b": ("<|startoftext|>", "<|return|>", "harmony-final", None),
    "gpt_oss_rev2": ("<|startoftext|>", "<|return|>", "harmony", None),
    "phi3_mini_instruct": ("<s>", "<|endoftext|>", "as-is", "<|end|>"),
    "phi3.5_mini_instruct": ("<s>", "<|endoftext|>", "as-is", "<|end|>"),
    "phi4": (None, "<|im_end|>", "as-is", "<|im_end|>"),
}

REPLIES = [("step one", "hello you"), ("step two", "fine thanks"), ("step three", "bye now")]
USERS = ["hi there", "how are things", "and now"]


def assistant(reasoning: str | None, thought: str, answer: str) -> dict:
    """An assistant message: reasoning None (the answer alone), "inline" (<think>...</think> in
    the content) or "field" (gpt-oss's `thinking`)."""
    if reasoning == "inline":
        return {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}
    if reasoning == "field":
        return {"role": "assistant", "content": answer, "thinking": thought}
    return {"role": "assistant", "content": answer}


def conversation(reasoning: str | None) -> list[dict]:
    """System + 3 user/assistant turns, the replies with `reasoning` (see `assistant`)."""
    out = [{"role": "system", "content": "be brief"}]
    for user, (thought, answer) in zip(USERS, REPLIES):
        out += [{"role": "user", "content": user}, assistant(reasoning, thought, answer)]
    return out


def prompts(reasoning: str | None) -> list[list[dict]]:
    """A 1-turn prompt, and a 2-turn one: system, user, an assistant turn with `reasoning`,
    user."""
    return [[{"role": "user", "content": USERS[1]}], conversation(reasoning)[:4]]


def expected_reply(style: str, eot: str | None, reasoning: str | None, thought: str, answer: str,
                   last: bool) -> str:
    """An assistant reply as the template renders it in the whole conversation, after the
    generation prompt, through the end-of-turn token (from reading each template); `last`: the
    conversation's final turn."""
    inline = f"<think>\n{thought}\n</think>\n\n{answer}"
    if style == "as-is":
        return (inline if reasoning == "inline" else answer) + eot
    if style == "spaced":  # ' ' + content + ' ' + eos, after ' [/INST]'
        return " " + (inline if reasoning == "inline" else answer) + " " + eot
    if style == "qwen3":  # reasoning only after the last user turn; the last turn always has a
        # (possibly empty) think block
        return (f"<think>\n{thought if reasoning else ''}\n</think>\n\n{answer}" if last
                else answer) + eot
    if style == "r1":  # content after </think>, every turn
        return ("\n\n" if reasoning == "inline" else "") + answer + eot
    # harmony: analysis of the last turn only; the final ends <|return|> (harmony-final: the
    # generation prompt already opens the final channel)
    head = "" if style == "harmony-final" else "<|channel|>final<|message|>"
    if last and reasoning == "field":
        head = ("analysis" if style == "harmony-final" else "<|channel|>analysis")
        head += f"<|message|>{thought}<|end|><|start|>assistant<|channel|>final<|message|>"
    return head + answer + ("<|return|>" if last else "<|end|>")


def expected_replies(style: str, eot: str | None, reasoning: str | None) -> list[str]:
    """Each assistant reply of `conversation(reasoning)` as the template renders it."""
    return [expected_reply(style, eot, reasoning, thought, answer, k == len(REPLIES) - 1)
            for k, (thought, answer) in enumerate(REPLIES)]


def tokenizer(folder, name: str):
    from transformers import GPT2TokenizerFast
    bos, eos, _, _ = CASES[name]
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tok = GPT2TokenizerFast(*small_gpt2(folder))
    controls = sorted(set(CONTROL.findall(template)) | {"<s>", "</s>"} - {None, bos, eos})
    tok.add_special_tokens({"bos_token": bos or "<|endoftext|>", "eos_token": eos,
                            "additional_special_tokens": controls})
    if bos is None:
        tok.bos_token = None
    tok.chat_template = template
    return tok


def expected_mask(tok, text: str, replies: list[str]) -> list[int]:
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask, cursor = [0] * len(offsets), 0
    for reply in replies:
        start = text.index(reply, cursor)
        cursor = start + len(reply)
        for j, (s, e) in enumerate(offsets):
            mask[j] |= int(e > start and s < cursor)
    return mask


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tok")


def same_mask(tok, tokens, got, want, what) -> None:
    got = got.tolist()
    if got != want:
        bad = [j for j in range(len(want)) if got[j] != want[j]]
        pytest.fail(f"{what}: mask differs at tokens {bad[:8]}: "
                    f"{tok.decode(tokens[bad[0]:bad[0] + 6].tolist())!r}")


def check(tok, name: str) -> None:
    """ChatRenderer's tokens and mask of the plain and the reasoning conversation under `name`,
    then preference pairs after a 1-turn and a 2-turn prompt (`check_pairs`)."""
    renderer = ChatRenderer(tok, name=name)
    assert renderer.marks_generation == (name == "smollm3_3b")  # the one that marks its replies
    style, eot = CASES[name][2], CASES[name][3]
    kinds = (None, "field") if style.startswith("harmony") else (None, "inline")
    for reasoning in kinds:
        messages = conversation(reasoning)
        r = renderer.render({"messages": messages})
        want = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert r.tokens.tolist() == list(want), (name, reasoning)
        text = tok.apply_chat_template(messages, tokenize=False)
        mask = expected_mask(tok, text, expected_replies(style, eot, reasoning))
        same_mask(tok, r.tokens, r.assistant_mask, mask, f"{name} ({reasoning})")
    check_pairs(renderer, tok, name, kinds[1])


def check_pairs(renderer, tok, name: str, reasoning: str) -> None:
    """DPO's pairs (chosen: a reply with reasoning, rejected: a plain one) after each of
    `prompts(reasoning)`: the tokens are apply_chat_template of prompt + reply, the mask exactly
    the final reply and its end-of-turn token (not the prompt's assistant turn)."""
    style, eot = CASES[name][2], CASES[name][3]
    thought, answer = REPLIES[2]
    replies = [(assistant(reasoning, thought, answer), reasoning, thought, answer),
               (assistant(None, "", "no idea"), None, "", "no idea")]
    for prompt in prompts(reasoning):
        pair = render_pair(renderer, {"prompt": prompt, "chosen": [replies[0][0]],
                                      "rejected": [replies[1][0]]})
        for r, (reply, kind, think, text) in zip(pair, replies):
            messages = prompt + [reply]
            what = f"{name} pair after {len(prompt)} messages ({kind})"
            want = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            assert r.tokens.tolist() == list(want), what
            rendered = tok.apply_chat_template(messages, tokenize=False)
            reply_text = expected_reply(style, eot, kind, think, text, True)
            mask = expected_mask(tok, rendered, [reply_text])
            same_mask(tok, r.tokens, r.assistant_mask, mask, what)


def check_generation_prompts(tok, name: str, folder) -> None:
    """GRPO's prompt tokens (training/run/grpo_prompts.py, through the tokenizer folder as the
    trainer loads it) equal apply_chat_template(prompt, add_generation_prompt=True)."""
    from megazoo.data.tokenizers import HFTokenizer
    from megazoo.training.run.grpo_prompts import render
    tok.save_pretrained(folder / name)
    loaded = HFTokenizer(str(folder / name))
    reasoning = "field" if CASES[name][2].startswith("harmony") else "inline"
    for prompt in prompts(reasoning):
        want = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
        assert render(loaded, {"messages": prompt}, True, name) == want, (name, len(prompt))
        if len(prompt) == 1:  # a string prompt with --grpo-chat: one user turn
            assert render(loaded, {"prompt": prompt[0]["content"]}, True, name) == want, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_released_template_masks_each_reply_and_its_end_of_turn(folder, name):
    """SFT's conversations, DPO's pairs and GRPO's prompts under the template."""
    tok = tokenizer(folder, name)
    check(tok, name)
    check_generation_prompts(tok, name, folder)


# What TRL 1.16's DPOTrainer learns beyond each reply and its end-of-turn token: its mask is
# every token after the common prefix of the prompt (with the generation prompt) and both
# renderings of prompt + reply. (template, prompt messages, reply) -> text; "*" any.
TRL_EXTRA = {**{(n, "*", "*"): "\n" for n in ("qwen2.5_7b_instruct", "qwen3_0.6b", "qwen3_rev2",
                                              "smollm2_135m_instruct", "smollm3_3b", "gemma3_it")},
             ("phi3_mini_instruct", "*", "*"): "\n<|endoftext|>",
             ("phi3.5_mini_instruct", "*", "*"): "\n<|endoftext|>",
             # the prompt alone ends the final-channel header the reasoning reply replaces
             ("gpt_oss_120b", "*", "rejected"): "final<|message|>",
             # the system prompt moves to the last user turn of the prompt alone
             ("mistral_nemo_instruct_2407", 4, "*"): "how are things[/INST]"}


def trl_dpo_pairs(tok, name: str, records: list[dict]):
    """(record, key, TRL's tokenization, megazoo's `Rendered`) for each reply of each pair:
    TRL 1.16's own DPO tokenization (`DPOTrainer._prepare_dataset`, called without a model)
    beside megazoo's `render_pair`, whose tokens must equal TRL's prompt + reply ids."""
    import datasets
    from trl.trainer.dpo_trainer import DPOTrainer
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    renderer = ChatRenderer(tok, name=name)
    theirs = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok),
                                         datasets.Dataset.from_list(records), tok, args, name)
    for record, trl in zip(records, theirs):
        for key, ours in zip(("chosen", "rejected"), render_pair(renderer, record)):
            assert trl["prompt_ids"] + trl[key + "_ids"] == ours.tokens.tolist(), \
                (name, len(record["prompt"]), key)
            yield record, key, trl, ours


def test_trl_dpo_trainer_gives_the_same_tokens_and_masks_that_differ_as_documented(folder):
    """TRL's own DPO tokenization of the pairs `check_pairs` renders: the tokens equal megazoo's
    for every template, and its mask covers megazoo's plus exactly `TRL_EXTRA`
    (docs/post_training.md)."""
    for name in sorted(CASES):
        tok = tokenizer(folder, name)
        reasoning = "field" if CASES[name][2].startswith("harmony") else "inline"
        records = [{"prompt": prompt, "chosen": [assistant(reasoning, *REPLIES[2])],
                    "rejected": [assistant(None, "", "no idea")]} for prompt in prompts(reasoning)]
        for record, key, trl, ours in trl_dpo_pairs(tok, name, records):
            what = (name, len(record["prompt"]), key)
            start, mask = len(trl["prompt_ids"]), ours.assistant_mask.tolist()
            assert not any(mask[:start]), what  # TRL learns all megazoo learns
            extra = [t for t, m in zip(ours.tokens[start:].tolist(), mask[start:]) if not m]
            want = next((v for k, v in TRL_EXTRA.items()
                         if all(a in ("*", b) for a, b in zip(k, what))), "")
            assert tok.decode(extra) == want, what


def test_sentencepiece_tokenizer_with_the_mistral_and_gemma_templates():
    """The same over a SentencePiece BPE (a word-initial '▁', as Mistral's and Gemma's own
    tokenizers): offsets of '▁'-prefixed pieces still cover exactly the replies."""
    from transformers import LlamaTokenizerFast

    from tests.fixtures import SENTENCEPIECE_MODELS
    model = next(m for m in SENTENCEPIECE_MODELS if m.name == "botchan_en_bpe_1000.model")
    tok = LlamaTokenizerFast(vocab_file=str(model), legacy=False)
    names = ["mistral_7b_instruct_v0.3", "mistral_nemo_instruct_2407", "gemma3_it"]
    controls = set()
    for name in names:
        controls |= set(CONTROL.findall((TEMPLATES / f"{name}.jinja").read_text()))
    tok.add_special_tokens({"additional_special_tokens": sorted(controls | {"<bos>", "<eos>"})})
    for name in names:
        tok.bos_token, tok.eos_token = CASES[name][:2]
        tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        check(tok, name)


def test_refusals_dropped_messages_and_fallbacks_say_so(folder, caplog):
    caplog.set_level("WARNING", logger="megazoo.data.chat")
    twice = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "hello"}]}
    refused = "(?i)refuses the conversation: .*conversation roles must alternate"
    for name in ("mistral_nemo_instruct_2407", "gemma3_it"):  # the template raises: one line
        with pytest.raises(SkipRecord, match=refused):
            ChatRenderer(tokenizer(folder, name), name=name).render(twice)
    # Mistral Nemo renders the system prompt only with a user turn that is the last message
    nemo = ChatRenderer(tokenizer(folder, "mistral_nemo_instruct_2407"), name="nemo")
    nemo.render({"messages": conversation(None)})
    nemo.render({"messages": conversation(None)})
    dropped = [r.getMessage() for r in caplog.records
               if "renders nothing of some system" in r.getMessage()]
    assert len(dropped) == 1, dropped  # logged once per renderer
    # generation marks that leave out the end-of-turn token are kept, and said
    caplog.clear()
    short = tokenizer(folder, "qwen2.5_7b_instruct")
    short.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == "
                           "'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                           "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not ChatRenderer(short, name="short").trims_marks
    assert any("leave out 2 tokens" in r.getMessage() for r in caplog.records)
    # SmolLM3's {% generation %} spans include the role header: cut to the replies, and said
    caplog.clear()
    smol = ChatRenderer(tokenizer(folder, "smollm3_3b"), name="smollm3")
    assert smol.trims_marks and "cut to the located replies" in smol.method
    assert any("cover" in r.getMessage() and "outside the assistant replies" in r.getMessage()
               for r in caplog.records)
    # a reply that opens the conversation starts after the generation prompt (Qwen2.5 writes
    # its default system prompt first)
    qwen = tokenizer(folder, "qwen2.5_7b_instruct")
    opening = ChatRenderer(qwen).render({"messages": [{"role": "assistant", "content": "hello you"},
                                                      {"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "bye"}]})
    learned = [t for t, m in zip(opening.tokens.tolist(), opening.assistant_mask.tolist()) if m]
    assert qwen.decode(learned) == "hello you<|im_end|>bye<|im_end|>"
    # a template with no special token after the reply: prefix renderings, logged; when those
    # disagree too, the record is skipped with both reasons and the fix
    tok = tokenizer(folder, "qwen2.5_7b_instruct")
    plain = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")
    tok.chat_template = plain
    caplog.clear()
    r = ChatRenderer(tok, name="plain").render({"messages": conversation(None)})
    assert r.assistant_mask.any()
    assert any("no special end-of-turn token" in x.getMessage()
               and "prefix renderings" in x.getMessage() for x in caplog.records)
    # DPO's pairs take the same fallback; the prompt's assistant turn is not learned, neither
    # through the prefix renderings nor through a template's own {% generation %} marks
    pair = {"prompt": conversation(None)[:4], "chosen": "bye now", "rejected": "no idea"}
    learned = [tok.decode(r.tokens[r.assistant_mask == 1].tolist())
               for r in render_pair(ChatRenderer(tok), pair)]
    assert learned == [" bye now\n", " no idea\n"]
    marked = plain.replace("{{ m.content }}", "{% if m.role == 'assistant' %}{% generation %}"
                           "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}")
    tok.chat_template = marked.replace(": ", ":\n").replace("assistant:", "assistant:\n")
    learned = [tok.decode(r.tokens[r.assistant_mask == 1].tolist())
               for r in render_pair(ChatRenderer(tok), pair)]
    assert learned == ["bye now", "no idea"]
    tok.chat_template = "{{ messages | length }}" + tok.chat_template  # prefixes disagree too
    with pytest.raises(SkipRecord, match=r"no special end-of-turn token.*prefix renderings "
                                         r"disagree.*marks cannot be cut to the reply"):
        render_pair(ChatRenderer(tok), pair)
    with pytest.raises(SkipRecord, match="'rejected' has no assistant message"):
        render_pair(ChatRenderer(tok), {**pair, "rejected": [{"role": "user", "content": "no"}]})
    tok.chat_template = "{{ messages | length }}" + plain
    both = r"no special end-of-turn token.*mark the replies with \{% generation %\}"
    with pytest.raises(SkipRecord, match=both):
        ChatRenderer(tok, name="counted").render({"messages": conversation(None)})
