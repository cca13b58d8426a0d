"""GRPO inside the trainer (train_llama.py --grpo-prompts, training/run/grpo_train.py) on a tiny
imported Llama: three iterations with megazoo's optimizer and checkpoints, the KL to the
imported start; a run resumed at iteration 2 continues bit for bit; tp2 and dp2 with ZeRO-1 and
ZeRO-2 (one spawned 2-rank world) sample the same completions, get the same rewards and log the
same losses and KL as the single process; with LoRA the reference is the base with the adapters
off (equal to an explicit frozen copy); the flags GRPO cannot honour are refused in one line.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_argv, chat_llama_folder, run_llama
from tests.tokenizer_data import CHATML_PLAIN

WORDS = "a b c d e f g h i j k l m n o p"
KEYS = ("loss", "reward_mean", "reward_std", "kl", "completion_length_mean")


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
    i = argv.index("--data-path")
    argv = argv[:i] + argv[i + 2:]
    if not finetune:
        argv.remove("--finetune")
    return argv


def history(result) -> list[list[float]]:
    return [[d[k] for k in KEYS] for d in result.grpo]


def _layouts(rank, argvs):
    return [history(run_llama(argv, 2)) for argv in argvs]
