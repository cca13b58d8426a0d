"""GRPO inside the trainer (train_llama.py --grpo-prompts, training/run/grpo_train.py) on a tiny
imported Llama: three iterations with megazoo's optimizer and checkpoints, the KL to the
imported start; a run resumed at iteration 2 continues bit for bit; tp2 and dp2 with ZeRO-1 and
ZeRO-2, and LoRA at tp2 and at dp2 with ZeRO-1 (one spawned 2-rank world) sample the same
completions, get the same rewards and log the same losses and KL as the single process; with
LoRA the reference is the base with the adapters off (equal to an explicit frozen copy); the
flags GRPO cannot honour are refused in one line.
"""
from __future__ import annotations

import json
import re
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_argv, chat_llama_folder, run_llama
from tests.tokenizer_data import CHATML_PLAIN

WORDS = "a b c d e f g h i j k l m n o p"
KEYS = ("loss", "reward_mean", "reward_std", "kl", "completion_length_mean")
LORA = ("--lora-rank", 4, "--lora-alpha", 8, "--lora-target-modules",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


def count_target(prompts, completions, target, **kw):
    """Reward: how often the record's `target` word occurs in the completion."""
    return [float(c.split().count(t)) for c, t in zip(completions, target)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from megazoo.training.checkpoint.hf import import_hf
    root = str(tmp_path_factory.mktemp("grpo_train"))
    folder = chat_llama_folder(root, [WORDS], CHATML_PLAIN)
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    with open(os.path.join(root, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "a b c", "target": "a"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "d e"}], "target": "b"}) + "\n")
        f.write(json.dumps({"prompt": "f g", "target": "c"}) + "\n")
    return root


def grpo_argv(root: str, iters: int, *extra, finetune: bool = True) -> list[str]:
    argv = chat_llama_argv(os.path.join(root, "hf"), os.path.join(root, "ckpt"), "unused", 32,
                           "--grpo-prompts", os.path.join(root, "prompts.jsonl"),
                           "--reward", "tests.training.test_grpo_train:count_target",
                           "--num-generations", 3, "--max-completion-length", 6, "--beta", 0.04,
                           "--micro-batch-size", 3, "--global-batch-size", 6, "--train-iters", iters,
                           "--lr", 1e-2, "--log-interval", 1, "--seed", 7, *extra)
    for flag in ("--data-path", "--split"):  # no dataset
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2:]
    if not finetune:
        argv.remove("--finetune")
    return argv


def history(result) -> list[list[float]]:
    return [[d[k] for k in KEYS] for d in result.grpo]


def _layouts(rank, argvs):
    return [history(run_llama(argv, 2)) for argv in argvs]


def weights_and_states(folder: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "rank_00000.safetensors"))


def test_run_logs_every_metric_and_resumes_bit_for_bit(root):
    full = run_llama(grpo_argv(root, 3, "--save", os.path.join(root, "full")), 1)
    rows = [json.loads(line) for line in open(os.path.join(root, "full", "metrics.jsonl"))]
    grpo = [r for r in rows if r.get("split") == "grpo"]
    assert [r["iteration"] for r in grpo] == [1, 2, 3]
    for key in (*KEYS, "clip_ratio", "completion_length_max", "generation_time", "training_time"):
        assert all(isinstance(r[key], float) for r in grpo), key
    assert [r["loss"] for r in grpo] == full.losses
    assert grpo[0]["kl"] == 0.0 and grpo[1]["kl"] > 0  # the start is the reference
    assert len({r["reward_mean"] for r in grpo}) > 1  # the samples change with the weights
    half = os.path.join(root, "half")
    run_llama(grpo_argv(root, 2, "--save", half), 1)
    resumed = run_llama(grpo_argv(root, 3, "--load", half, "--save", half, "--grpo-reference",
                                  os.path.join(root, "ckpt"), finetune=False), 1)
    assert resumed.losses == full.losses[2:] and history(resumed) == history(full)[2:]
    a = weights_and_states(os.path.join(root, "full", "iter_0000003"))
    b = weights_and_states(os.path.join(half, "iter_0000003"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the run history this module's layouts compare with
    with open(os.path.join(root, "single.json"), "w") as f:
        json.dump(history(full), f)


def test_tp2_and_dp2_zero1_zero2_equal_the_single_process(root):
    single = history(run_llama(grpo_argv(root, 3), 1))
    single_lora = history(run_llama(grpo_argv(root, 3, *LORA), 1))
    layouts = [grpo_argv(root, 3, "--tensor-model-parallel-size", 2),
               grpo_argv(root, 3, "--zero-stage", 1),
               grpo_argv(root, 3, "--zero-stage", 2),
               grpo_argv(root, 3, "--tensor-model-parallel-size", 2, *LORA),
               grpo_argv(root, 3, "--zero-stage", 1, *LORA)]
    ranks = run_distributed(_layouts, 2, layouts)
    assert ranks[0] == ranks[1]  # every rank logs the whole batch's metrics
    worst = []
    for run, want_run in zip(ranks[0], [single] * 3 + [single_lora] * 2):
        assert len(run) == len(want_run) == 3
        worst.append(0.0)
        for got, want in zip(run, want_run):
            assert got[1] == want[1] and got[4] == want[4]  # rewards and lengths: the same samples
            for g, w in zip(got, want):
                assert abs(g - w) <= 1e-5 * max(1.0, abs(w)), (got, want)
                worst[-1] = max(worst[-1], abs(g - w))
    print("largest difference to the single process (tp2, dp2 ZeRO-1, dp2 ZeRO-2, LoRA tp2, "
          "LoRA dp2 ZeRO-1):", " ".join(f"{w:.1e}" for w in worst))



def test_lora_reference_is_the_base_with_the_adapters_off(root):
    import dataclasses

    from megazoo.data.tokenizers import build_tokenizer
    from megazoo.models.registry import build_model
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.dpo import build_reference
    from megazoo.training.run.trainer import Trainer
    # through the trainer: the adapters start at B = 0, so the first step's KL is 0
    lora = run_llama(grpo_argv(root, 2, *LORA), 1)
    assert lora.grpo[0]["kl"] == 0.0 and lora.grpo[1]["kl"] > 0
    args = build_parser().parse_args(grpo_argv(root, 1, *LORA))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=os.path.join(root, "hf"))
    run = to_run_config(args, world_size=1, vocab_size=tok.vocab_size, eod_token=tok.eod)
    trainer = Trainer(build_model, run)
    try:
        chunk, reference = trainer.chunks[0], trainer.grpo.reference
        assert reference.frozen is None  # no second copy of the model
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # adapters away from their start, so they change the logits
            for p in chunk.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        copy = build_reference(dataclasses.replace(run, lora=None), trainer.topo, trainer.chunks,
                               build_model, os.path.join(root, "ckpt")).frozen[0]
        tokens = torch.randint(0, tok.vocab_size, (3, 12), generator=g)
        base = reference.per_token(chunk, tokens[:, :-1], tokens[:, 1:])
        frozen = copy(tokens[:, :-1], labels=tokens[:, 1:])
        with torch.no_grad():
            policy = chunk(tokens[:, :-1], labels=tokens[:, 1:])
        gap = (base - frozen).abs().max().item()
        print(f"adapters-off reference vs frozen copy: {gap:.2e} (adapters move the loss by "
              f"{(policy - frozen).abs().max().item():.2f})")
        assert gap <= 1e-6 and (policy - frozen).abs().max() > 1e-2
    finally:
        trainer.close()


@pytest.mark.parametrize("extra, message", [
    (("--pipeline-model-parallel-size", 2), "--pipeline-model-parallel-size 1"),
    (("--tensor-model-parallel-size", 2, "--sequence-parallel"), "no --sequence-parallel"),
    (("--zero-stage", 3), "--zero-stage 1 or 2"),
    (("--micro-batch-size", 1), "must equal --num-generations"),
    (("--health-policy", "rollback", "--save", "x", "--save-interval", 1), "rollback"),
    (("--data-path", "x"), "drop --data-path"),
    (("--split", "98,2,0"), "drop --split"),
    (("--rampup-batch-size", 2, 2, 10), "drop --rampup-batch-size"),
    (("--lora-rank", 4, "--grpo-reference", "x"), "drop --grpo-reference"),
    (("--reward-weights", 1.0, 2.0), "--reward-weights gives 2 weights for 1 --reward functions"),
    (("--num-iterations", 0), "--num-iterations must be >= 1"),
])
def test_flags_grpo_cannot_honour_are_refused(root, extra, message):
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    args = build_parser().parse_args(grpo_argv(root, 1, *[str(a) for a in extra]))
    with pytest.raises(ArgumentError, match=re.escape(message)):
        to_run_config(args, world_size=2, vocab_size=21, eod_token=0)


def test_grpo_flags_need_grpo_prompts(root):
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    argv = grpo_argv(root, 1)
    i = argv.index("--grpo-prompts")
    args = build_parser().parse_args(argv[:i] + argv[i + 2:] + ["--data-path", "x"])
    with pytest.raises(ArgumentError, match="needs --grpo-prompts"):
        to_run_config(args, world_size=1, vocab_size=21, eod_token=0)


def test_tool_is_an_alias_of_the_training_script(root):
    from megazoo.tools.grpo import alias_argv, main
    family, argv = alias_argv(["--load", os.path.join(root, "ckpt"), "--grpo-prompts", "p.jsonl"])
    assert family == "llama"
    assert argv[-4:] == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                         os.path.join(root, "ckpt", "tokenizer")]
    assert main(["--load", os.path.join(root, "ckpt")]) == 2  # no --grpo-prompts: one line


def test_a_bad_reward_or_prompts_file_is_one_line(root):
    from megazoo.training.config.errors import ArgumentError
    argv = grpo_argv(root, 1)
    i = argv.index("--reward")
    with pytest.raises(ArgumentError, match="--reward 'nomodule:fn': No module named 'nomodule'"):
        run_llama(argv[:i + 1] + ["nomodule:fn"] + argv[i + 2:], 1)
    bad = os.path.join(root, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "a"}\n')
    i = argv.index("--grpo-prompts")
    with pytest.raises(ArgumentError, match=r"bad.jsonl line 1: need a `prompt` \(a string or "
                                            r"messages\) or `messages`"):
        run_llama(argv[:i + 1] + [bad] + argv[i + 2:], 1)


def test_example_learns_its_reward(tmp_path, monkeypatch):
    """examples/grpo through tools/grpo.py (the trainer): the prompt-free reward (the share of
    7s) rises within 8 steps; the arithmetic task itself takes minutes (docs/post_training.md)."""
    import runpy
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "grpo")
    monkeypatch.syspath_prepend(here)
    monkeypatch.setattr(sys, "argv", ["run_example.py", "--reward", "sevens", "--warmup-steps", "0",
                                      "--max-operand", "9", "--lr", "1e-2", "--steps", "8",
                                      "--work", str(tmp_path)])
    try:
        runpy.run_path(os.path.join(here, "run_example.py"), run_name="__main__")
    except SystemExit as e:
        assert not e.code
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rewards = [r["reward_mean"] for r in rows if r.get("split") == "grpo"]
    assert len(rewards) == 8 and sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.3, rewards


def always_half(prompts, completions, **kw):
    return [0.5] * len(completions)


def test_num_iterations_reuse_the_batch_and_clip(root):
    """--num-iterations 2: iterations 1 and 2 train on the same sampled batch (same rewards and
    lengths), the second against the sampling policy's log-probabilities, so its ratio moves and
    the clip fraction is > 0 (0 on the first); iteration 3 samples anew. Two rewards with
    --reward-weights are summed and each logged; --mask-truncated-completions logs its fraction."""
    argv = grpo_argv(root, 3, "--num-iterations", 2, "--mask-truncated-completions",
                     "--reward-weights", 2.0, 1.0)
    i = argv.index("--reward")
    argv[i + 1] = "tests.training.test_grpo_train:count_target,tests.training.test_grpo_train:always_half"
    h = run_llama([str(a) for a in argv], 1).grpo
    assert h[0]["reward_mean"] == h[1]["reward_mean"] and h[0]["reward_std"] == h[1]["reward_std"]
    assert h[0]["completion_length_mean"] == h[1]["completion_length_mean"]
    print("clip fraction per iteration:", [round(d["clip_ratio"], 3) for d in h],
          "truncated fraction:", [round(d["truncated_fraction"], 3) for d in h])
    assert h[0]["clip_ratio"] == 0.0 and h[1]["clip_ratio"] > 0.0, [d["clip_ratio"] for d in h]
    for d in h:
        assert d["reward_mean"] == pytest.approx(2.0 * d["reward_0_mean"] + 0.5, abs=1e-6)
        assert d["reward_1_mean"] == 0.5 and 0.0 <= d["truncated_fraction"] <= 1.0

