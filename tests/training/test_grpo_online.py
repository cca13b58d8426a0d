"""GRPO's online step (training/run/grpo_online.py) on a tiny imported Llama (runs through the
trainer: tests/training/test_grpo_train.py): one step's gradient (groups sampled with the
training weights, one backward per group) equals the gradient of training/run/grpo.py's `grpo_loss` over the whole sampled batch at once, with the
KL to a perturbed frozen reference, for a token-normalised and a sequence-normalised loss type.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_folder
from tests.tokenizer_data import CHATML_PLAIN

WORDS = "a b c d e f g h i j k l m n o p"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    from megazoo.training.checkpoint.hf import import_hf
    root = str(tmp_path_factory.mktemp("grpo_online"))
    folder = chat_llama_folder(root, [WORDS], CHATML_PLAIN)
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    return root


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
