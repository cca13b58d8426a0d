"""GRPO's online loop (training/run/grpo_online.py, tools/grpo.py) on a tiny imported Llama: the
tool runs two steps from a jsonl of prompts (plain and chat `messages`), the rewards come from
the named function (called with the records' other fields) and every metric is logged; at tp2
and at dp2 (one spawned world) it samples the same completions and logs the same metrics; one
step's gradient (groups sampled with the training weights, one backward per group) equals the
gradient of training/run/grpo.py's `grpo_loss` over the whole sampled batch at once, with the
KL to a perturbed frozen reference, for a token-normalised and a sequence-normalised loss type.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_folder
from tests.tokenizer_data import CHATML_PLAIN

WORDS = "a b c d e f g h i j k l m n o p"
CALLS: list[dict] = []


def count_a(prompts, completions, target, **kw):
    """Reward: how often the record's `target` word occurs in the completion."""
    values = [float(c.split().count(t)) for c, t in zip(completions, target)]
    CALLS.append(dict(n=len(completions), prompts=len(prompts), values=values))
    return values


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    from megazoo.training.checkpoint.hf import import_hf
    root = str(tmp_path_factory.mktemp("grpo_online"))
    folder = chat_llama_folder(root, [WORDS], CHATML_PLAIN)
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    return root


def tool_argv(root: str, save: str) -> list[str]:
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt": "a b c", "target": "a"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "d e"}], "target": "b"}) + "\n")
    return ["--load", os.path.join(root, "ckpt"), "--prompts", prompts, "--reward",
            "tests.training.test_grpo_online:count_a", "--save", save, "--train-iters", "2",
            "--prompts-per-step", "2", "--grpo-num-generations", "3",
            "--grpo-max-completion-length", "6", "--grpo-beta", "0.04", "--lr", "1e-3"]


def _tool_ranks(rank, *argvs):
    from megazoo.tools.grpo import main
    return [main(argv) for argv in argvs]


def test_tool_runs_logs_and_calls_the_reward_tp1_and_tp2(ckpt_dir):
    from megazoo.tools.grpo import main
    from tests.distributed import run_distributed
    save = os.path.join(ckpt_dir, "run")
    CALLS.clear()
    assert main(tool_argv(ckpt_dir, save)) == 0
    rows = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [1, 2] and all(r["split"] == "grpo" for r in rows)
    for key in ("loss", "reward_mean", "reward_std", "kl", "clip_ratio", "completion_length_mean",
                "completion_length_max", "generation_time", "training_time"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert [c["n"] for c in CALLS] == [6, 6] and all(c["prompts"] == 6 for c in CALLS)
    for row, call in zip(rows, CALLS):
        assert row["reward_mean"] == pytest.approx(sum(call["values"]) / 6, abs=1e-6)
    assert all(1 <= r["completion_length_mean"] <= 6 for r in rows)
    assert rows[1]["kl"] > 0  # the first step moved the policy away from the reference
    argv = tool_argv(ckpt_dir, save)
    assert main(argv[:5] + ["nomodule"] + argv[6:]) == 1
    # tp2 and dp2: the same samples (TP rank 0 draws; a generator per prompt), rewards, and
    # both steps' losses and KL (the second step after an update from the summed gradients)
    save2, save3 = os.path.join(ckpt_dir, "run_tp2"), os.path.join(ckpt_dir, "run_dp2")
    assert run_distributed(_tool_ranks, 2, tool_argv(ckpt_dir, save2),
                           tool_argv(ckpt_dir, save3) + ["--tp", "1"]) == [[0, 0], [0, 0]]
    rows2 = [json.loads(line) for line in open(os.path.join(save2, "metrics.jsonl"))]
    rows3 = [json.loads(line) for line in open(os.path.join(save3, "metrics.jsonl"))]
    assert len(rows2) == len(rows3) == 2
    for a, b in zip(rows + rows, rows2 + rows3):
        assert a["reward_mean"] == b["reward_mean"] and a["completion_length_mean"] == b["completion_length_mean"]
        for key in ("loss", "kl"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_step_gradient_equals_grpo_loss_on_the_sampled_batch(ckpt_dir, loss_type):
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.hf import load_model_chunks
    from megazoo.training.run.dpo import Reference
    from megazoo.training.run.grpo import completion_logps, grpo_loss
    from megazoo.training.run.grpo_online import GRPOSettings, grpo_step
    topo = ParallelTopology.from_config(ParallelConfig())
    folder = ckpt.resolve(os.path.join(ckpt_dir, "ckpt"))
    _, (chunk,) = load_model_chunks(folder, topo)
    _, (frozen,) = load_model_chunks(folder, topo)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in frozen.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    chunk.train()
    settings = GRPOSettings(num_generations=3, max_completion_length=5, beta=0.04, loss_type=loss_type,
                            epsilon_high=0.28)
    reward = lambda prompts, completions, **kw: [float(len(c.split()) % 3) + 0.1 * i  # noqa: E731
                                                 for i, c in enumerate(completions)]
    records = [{"prompt": "x"}, {"prompt": "y"}]
    prompts = [[5, 6, 7], [8, 9, 10]]  # one length: the whole batch is one tensor for the reference
    chunk.zero_grad()
    out = grpo_step(chunk, topo, records, prompts, reward, lambda ids: " ".join(map(str, ids)), settings,
                    (0,), Reference([chunk], [frozen]), [torch.Generator().manual_seed(k) for k in (0, 1)])
    ours = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    batch = out["_batch"]
    tokens = torch.cat([t for t, _ in batch["groups"]])
    mask = torch.cat([m for _, m in batch["groups"]])
    chunk.zero_grad()
    logps = completion_logps(chunk, tokens, 5)
    with torch.no_grad():
        ref = completion_logps(frozen, tokens, 5)
    loss, stats = grpo_loss(logps, logps.detach(), batch["advantages"], mask, ref_logps=ref, beta=0.04,
                            epsilon_high=0.28, loss_type=loss_type, max_completion_length=5)
    loss.backward()
    assert out["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert out["kl"] == pytest.approx(stats["kl"], abs=1e-6)
    worst = max((ours[n] - p.grad).abs().max().item() for n, p in chunk.named_parameters())
    assert worst < 1e-6, worst
