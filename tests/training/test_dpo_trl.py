"""DPO against TRL's DPOTrainer: the same tiny Llama folder, preference pairs and
hyper-parameters (sigmoid loss, beta 0.1, AdamW at a constant learning rate).

megazoo runs the user's path in this process: import_hf -> tools/preprocess_dpo.py ->
pretrain(--dpo --load --finetune), the reference a frozen copy of the imported checkpoint; TRL
runs DPOTrainer (its reference loaded from the same folder). The set is one global batch (4
pairs; megazoo in two microbatches of 2 pairs), so both see the same pairs at every step. Loss,
chosen and rejected rewards, margins and policy log-probabilities over 5 steps within 1e-5
relative. Then the same with LoRA (PEFT's adapter under TRL, the reference the base with the
adapters off), the robust (label-smoothed) and IPO losses over 3 steps (the first has z = 0:
policy = reference), tp2 and dp2 with ZeRO-1 in one spawned world, and the held-out evaluation.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.distributed import run_distributed
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_argv, chat_llama_folder, run_llama
from tests.tokenizer_data import CHATML_PLAIN
from tests.tool_runs import load_tool

STEPS, BETA, LR, SEQ = 5, 0.1, 1e-2, 32
TOPICS = ["the sea", "a red kite", "bread", "rain on tin"]
KEYS = {"loss": "loss", "rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
        "rewards_margins": "rewards/margins", "logps_chosen": "logps/chosen",
        "logps_rejected": "logps/rejected"}


def pairs() -> list[dict]:
    """4 preference records in TRL's conversational form, replies of different lengths."""
    out = []
    for i, t in enumerate(TOPICS):
        out.append({"prompt": [{"role": "user", "content": f"tell me about {t}"}],
                    "chosen": [{"role": "assistant", "content": " ".join([t, "is", "fine"] * (1 + i % 2))}],
                    "rejected": [{"role": "assistant", "content": "no" if i % 2 else "i do not know"}]})
    return out


def trl_history(root: str, folder: str, data: list[dict], lora: bool, **loss) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    cfg = DPOConfig(output_dir=os.path.join(root, "trl"), beta=BETA, per_device_train_batch_size=len(data),
                    gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="constant",
                    warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, adam_beta1=0.9,
                    adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
                    max_steps=STEPS if not loss else 3, logging_steps=1, report_to=[], use_cpu=True,
                    save_strategy="no", bf16=False, fp16=False, seed=0, disable_tqdm=True,
                    dataset_num_proc=None, **loss)
    peft_config = None
    if lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype="float32"), args=cfg,
                         train_dataset=datasets.Dataset.from_list(data),
                         processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft_config)
    if lora:  # save the starting adapter: megazoo starts from it
        trainer.model.save_pretrained(os.path.join(root, "init"))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def megazoo_history(root: str, folder: str, lora: bool, *extra, world: int = 1) -> list[dict]:
    argv = chat_llama_argv(folder, os.path.join(root, "ckpt"), os.path.join(root, "prefs"), SEQ,
                           "--dpo", "--dpo-beta", BETA, "--micro-batch-size", 4,
                           "--global-batch-size", 8, "--train-iters", STEPS if not extra else 3,
                           "--lr", LR, "--min-lr", LR, "--log-interval", 1, *extra,
                           *(["--lora-init", os.path.join(root, "init")] if lora else []))
    result = run_llama(argv, world=world)
    return [dict(loss=loss, **d) for loss, d in zip(result.losses, result.dpo)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dpo"))
    data = pairs()
    with open(os.path.join(root, "prefs.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in data))
    texts = [m["role"] + " " + m["content"] for r in data for k in ("prompt", "chosen", "rejected")
             for m in r[k]]
    folder = chat_llama_folder(root, texts, CHATML_PLAIN)
    from megazoo.training.checkpoint.hf import import_hf
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    dpo = load_tool("preprocess_dpo")
    summary = dpo.preprocess(dpo.parse_args(["--input", os.path.join(root, "prefs.jsonl"), "--output-prefix",
                                             os.path.join(root, "prefs"), "--tokenizer-model", folder,
                                             "--seq-length", str(SEQ)]))
    assert summary["pairs"] == len(data) and not summary["notes"]
    return dict(root=root, folder=folder, data=data)


def check(ours: list[dict], theirs: list[dict], steps: int) -> None:
    assert len(ours) == len(theirs) == steps
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        for k, trl_key in KEYS.items():
            assert abs(a[k] - b[trl_key]) <= 1e-5 * max(abs(b[trl_key]), 1e-3), \
                f"step {i} {k}: megazoo {a[k]}, TRL {b[trl_key]}"


def test_full_dpo_equals_trl_dpo_trainer(setup):
    root, folder = setup["root"], setup["folder"]
    theirs = trl_history(root, folder, setup["data"], lora=False)
    ours = megazoo_history(root, folder, lora=False)
    check(ours, theirs, STEPS)
    assert theirs[-1]["rewards/margins"] > theirs[0]["rewards/margins"]  # it learns


def test_lora_dpo_equals_trl_with_peft(setup):
    root, folder = setup["root"], setup["folder"]
    theirs = trl_history(root, folder, setup["data"], lora=True)
    ours = megazoo_history(root, folder, True)
    check(ours, theirs, STEPS)


@pytest.mark.parametrize("loss", [dict(loss_type=["robust"], label_smoothing=0.2), dict(loss_type=["ipo"])])
def test_robust_and_ipo_losses_equal_trl(setup, loss):
    root, folder = setup["root"], setup["folder"]
    theirs = trl_history(root, folder, setup["data"], lora=False, **loss)
    extra = ["--dpo-loss-type", loss["loss_type"][0]]
    if "label_smoothing" in loss:
        extra += ["--dpo-label-smoothing", loss["label_smoothing"]]
    ours = megazoo_history(root, folder, False, *extra)
    check(ours, theirs, 3)


def _layouts_worker(rank: int, root: str, folder: str) -> dict:
    layouts = {"tp2": ["--tensor-model-parallel-size", 2, "--sequence-parallel"],
               "dp2": ["--zero-stage", 1, "--use-distributed-optimizer"]}
    return {(name, lora): megazoo_history(root, folder, lora, *extra, "--train-iters", 3, world=2)
            for name, extra in layouts.items() for lora in (False, True)}


def test_tp2_and_dp2_zero_equal_the_single_process(setup):
    """Full and LoRA DPO (after the LoRA test wrote its starting adapter) in one 2-rank world."""
    root, folder = setup["root"], setup["folder"]
    if not os.path.isdir(os.path.join(root, "init")):
        trl_history(root, folder, setup["data"], lora=True)
    got = run_distributed(_layouts_worker, 2, root, folder, timeout=300)[0]
    for lora in (False, True):
        want = megazoo_history(root, folder, lora, "--train-iters", 3)
        for name in ("tp2", "dp2"):
            ours = got[(name, lora)]
            assert len(ours) == len(want) == 3
            for i, (a, b) in enumerate(zip(ours, want), 1):
                for k in KEYS:
                    assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1e-3), \
                        f"{name} lora={lora} step {i} {k}: {a[k]} vs {b[k]}"


def test_preprocess_dpo_strings_and_skipped_records(setup):
    """String prompts and replies are one user and one assistant turn (the same tokens as the
    messages); records that cannot train are counted and listed, not written."""
    from megazoo.data.preference import split_preference_datasets
    root, folder = setup["root"], setup["folder"]
    r = setup["data"][0]
    lines = [json.dumps({"prompt": r["prompt"][0]["content"], "chosen": r["chosen"][0]["content"],
                         "rejected": r["rejected"][0]["content"]}), "{not json", json.dumps({"prompt": "x"})]
    with open(os.path.join(root, "mixed.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dpo = load_tool("preprocess_dpo")
    summary = dpo.preprocess(dpo.parse_args(["--input", os.path.join(root, "mixed.jsonl"), "--output-prefix",
                                             os.path.join(root, "mixed"), "--tokenizer-model", folder]))
    assert summary["pairs"] == 1
    assert summary["notes"] == {"bad JSON": 1, "not a preference record": 1}
    strings = split_preference_datasets(os.path.join(root, "mixed"), "100,0,0", SEQ, 0, pad_id=0)[0]
    messages = split_preference_datasets(os.path.join(root, "prefs"), "100,0,0", SEQ, 0, pad_id=0)[0]
    first = [i for i in range(len(messages)) if messages.samples[i][0] in (0, 1)]
    for k in (0, 1):  # chosen, rejected
        a, b = strings[k], messages[first[k]]
        assert (a["tokens"] == b["tokens"]).all() and (a["assistant_mask"] == b["assistant_mask"]).all()


def test_evaluation_on_held_out_pairs(setup):
    """--split 50,50,0 with --eval-interval 1: after a step at learning rate 0 (policy = reference)
    the held-out loss is log 2, the rewards 0, and the held-out pairs' log-probabilities those
    transformers gives (the reply tokens after the prompt rendered with its generation prompt)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    root, folder, data = setup["root"], setup["folder"], setup["data"]
    tok, hf = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    want = {}
    for key in ("chosen", "rejected"):
        total = 0.0
        for r in data[2:]:
            start = len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])
            ids = torch.tensor([tok.apply_chat_template(r["prompt"] + r[key], tokenize=True,
                                                        return_dict=True)["input_ids"]])
            with torch.no_grad():
                logps = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])
            total += logps[start - 1:].sum().item()
        want["logps_" + key] = total / 2
    argv = chat_llama_argv(folder, os.path.join(root, "ckpt"), os.path.join(root, "prefs"), SEQ,
                           "--dpo", "--dpo-beta", BETA, "--micro-batch-size", 2, "--global-batch-size", 4,
                           "--train-iters", 1, "--lr", 0.0, "--min-lr", 0.0, "--split", "50,50,0",
                           "--eval-interval", 1, "--eval-iters", 1)
    result = run_llama(argv, world=1)
    (it, ours), = result.valid_dpo
    assert it == 1 and math.isclose(result.valid_losses[0][1], math.log(2), rel_tol=1e-6)
    assert ours["rewards_chosen"] == ours["rewards_rejected"] == ours["rewards_margins"] == 0.0
    for k, v in want.items():
        assert abs(ours[k] - v) <= 1e-5 * abs(v), (k, ours[k], v)
