"""Shared pieces of the ZeRO tests: a small GPT, its data, the plain-DP reference and a ZeRO run.

The reference is plain data parallelism: the full model on every rank, each rank's share of the
global batch, gradients all-reduced (mean) over the DP group, torch.nn.utils.clip_grad_norm_ and
torch.optim.AdamW with decay on matrices only. Everything here runs inside spawned workers.
"""
from __future__ import annotations

import torch

from models.config import TransformerConfig
from models.language_model import TransformerLanguageModel
from parallel import collectives as C
from parallel.sharding import full_tensor
from parallel.topology import ParallelConfig, ParallelTopology
from parallel.zero import OptimizerConfig, build_optimizer

GLOBAL_BATCH, SEQ, STEPS = 8, 8, 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, clip_grad=0.5)


def small_gpt(**kw) -> TransformerConfig:
    base = dict(vocab_size=101, hidden_size=48, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=96, max_position_embeddings=16, make_vocab_size_divisible_by=8,
                seed=7)
    return TransformerConfig(**{**base, **kw})


def batch(step: int, topo: ParallelTopology | None = None):
    """Step `step`'s global batch, or this DP rank's share of it."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 101, (GLOBAL_BATCH, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if topo is not None and topo.dp > 1:
        ids, labels = ids.chunk(topo.dp)[topo.dp_rank], labels.chunk(topo.dp)[topo.dp_rank]
    return ids, labels


def dp_mean(value: float, topo) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    C.all_reduce(t, topo.dp_group)
    return t.item() / topo.dp


def reference_run(topo: ParallelTopology, cfg: TransformerConfig, steps: int = STEPS):
    """Plain DP with torch.optim.AdamW: (per-step mean losses, full parameters, grad norms)."""
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                              "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    losses, norms = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        loss = model(ids, labels=labels).mean()
        loss.backward()
        for _, p in named:
            C.all_reduce(p.grad, topo.dp_group)
            p.grad /= topo.dp
        params = [p for _, p in named]
        norms.append(torch.nn.utils.clip_grad_norm_(params, HYPER["clip_grad"]).item()
                     if HYPER["clip_grad"] > 0 else
                     torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        opt.step()
        opt.zero_grad()
        losses.append(dp_mean(loss.item(), topo))
    single = ParallelTopology.single()
    return losses, {n: full_tensor(p, single).clone() for n, p in named}, norms


def initial_parameters(cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full parameters before training (weights are seeded by name: the same for every layout)."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, single)
    return {n: full_tensor(p, single).detach().clone() for n, p in model.named_parameters()}


def opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**HYPER, **kw})


def zero_run(topo: ParallelTopology, cfg: TransformerConfig, ocfg: OptimizerConfig,
             steps: int = STEPS, microbatches: int = 1, inject_inf_at: tuple[int, ...] = (),
             on_step=None):
    """Train with the ZeRO optimizer: (losses, full fp32 parameters, StepResults, optimizer)."""
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, ocfg)
    losses, results = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        total = 0.0
        for m, (i, y) in enumerate(zip(ids.chunk(microbatches), labels.chunk(microbatches))):
            last = m == microbatches - 1
            with (opt.no_sync() if not last else _null()):
                loss = model(i, labels=y).float().mean()
                if step in inject_inf_at and last:
                    loss = loss * float("inf")  # an fp16 overflow: every gradient becomes inf/NaN
                opt.backward(loss / microbatches)
            total += loss.item() / microbatches
        results.append(opt.step())
        opt.zero_grad()
        losses.append(dp_mean(total, topo))
        if on_step is not None:
            on_step(step, model, opt)
    return losses, full_model_parameters(model, opt, topo), results, opt


def full_model_parameters(model, opt, topo) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 parameter (DP-gathered by the optimizer, TP-gathered here)."""
    dp_full = opt.full_parameters()
    return {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
            for n, p in model.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def topology(**kw) -> ParallelTopology:
    return ParallelTopology.from_config(ParallelConfig(**kw))
