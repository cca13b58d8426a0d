"""Megatron-LM's distributed optimizer state (`--use-distributed-optimizer`, `distrib_optim.pt`).

With the legacy checkpoint format Megatron-LM saves, next to each `model_optim_rng.pt`, the
parameter state its DistributedOptimizer gathered on data-parallel rank 0
(`get_parameter_state_dp_zero` in megatron-core's optimizer/distrib_optimizer.py):

    {"buckets_coalesced": True,
     gbuf_idx: {dtype: {"param": fp32[n], "exp_avg": fp32[n], "exp_avg_sq": fp32[n],
                        "numel_unpadded": n}}}

(a list of these for a chained dense + expert optimizer). Each gbuf is one grad buffer: one per
model chunk (virtual stage) and parameter dtype, expert weights in the expert optimizer's. Its
flat tensors are the buffer's buckets with their end padding cut and joined; within a bucket
the parameters lie in reverse module order, each starting at a multiple of 64 elements
(megatron-core's distributed/param_and_grad_buffer.py). The buffer layout is not saved, so it
is rebuilt here from the parameters and the recorded arguments (bucket size), and checked
against the recorded `numel_unpadded`. The Adam step is in `model_optim_rng.pt`'s optimizer
`param_groups` (the parameters' state lives only here).
"""
from __future__ import annotations

import os

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import safe_load

FILE = "distrib_optim.pt"
_ALIGN = 64  # a parameter starts at a 128-byte address (>= 16-bit values)
_KEYS = ("param", "exp_avg", "exp_avg_sq")


def path_for(model_file: str) -> str | None:
    path = os.path.join(os.path.dirname(model_file), FILE)
    return path if os.path.isfile(path) else None


def bucket_size(args) -> int | None:
    """Megatron's bucket size: one bucket per buffer unless gradient reduction overlaps."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    dp = max(int(getattr(args, "data_parallel_size", 1) or 1), 1)
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)


def flat_ranges(numels: list[int], size: int | None, shared: list[bool]) -> tuple[list, int]:
    """[(start, end)] of each parameter (given in module order) in a buffer's joined unpadded
    buckets, and their total length (the file's numel_unpadded)."""
    out = [None] * len(numels)
    offset, pos, in_bucket = 0, 0, 0  # offset: joined length of the closed buckets
    for i in reversed(range(len(numels))):
        pos = -(-pos // _ALIGN) * _ALIGN  # buckets start aligned, so relative = absolute
        if shared[i] and in_bucket:  # a shared embedding gets a bucket of its own
            offset, pos, in_bucket = offset + pos, 0, 0
        end = pos + numels[i]
        out[i] = (offset + pos, offset + end)
        in_bucket += 1
        if (size is not None and end >= size) or shared[i]:
            offset, pos, in_bucket = offset + end, 0, 0
        else:
            pos = end
    return out, offset + (pos if in_bucket else 0)


def _step(sd: dict, path: str) -> int | None:
    opt = sd.get("optimizer")
    parts = opt if isinstance(opt, list) else [opt]
    steps = set()
    for part in parts:
        inner = (part or {}).get("optimizer", part) or {}
        steps |= {int(g["step"]) for g in inner.get("param_groups", []) if g.get("step") is not None}
    if len(steps) > 1:
        raise ckpt.CheckpointError(f"{path}: optimizer groups at different steps {sorted(steps)}")
    return steps.pop() if steps else None


def assign(chunks: list[list[tuple[str, torch.Tensor]]], sd: dict, model_file: str, args,
           *, shared_embedding: bool) -> dict:
    """key -> (Adam state {exp_avg, exp_avg_sq, step}, fp32 master) of every parameter of one
    rank file, `chunks` its virtual stages' (key, tensor) in module order."""
    path = path_for(model_file)
    saved = safe_load.load(path)
    optimizers = saved if isinstance(saved, list) else [saved]
    dense = [[(k, t) for k, t in c if ".mlp.experts." not in k] for c in chunks]
    expert = [[(k, t) for k, t in c if ".mlp.experts." in k] for c in chunks]
    groups = [g for g in (dense, expert) if any(g)]
    if len(groups) != len(optimizers):
        raise ckpt.CheckpointError(f"{path}: holds {len(optimizers)} optimizers' state, the model's "
                                   f"dense and expert weights call for {len(groups)}")
    step = _step(sd, model_file)
    size = bucket_size(args)
    out = {}
    for state, group in zip(optimizers, groups):
        if not isinstance(state, dict) or not state.get("buckets_coalesced"):
            raise ckpt.CheckpointError(f"{path}: not the coalesced-bucket layout of Megatron-core "
                                       f"0.6+ (saved before Feb 2024); load with --finetune")
        buffers = [c for c in group if c]
        for g, params in enumerate(buffers):
            by_dtype = state.get(g)
            if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
                raise ckpt.CheckpointError(f"{path}: grad buffer {g} missing or of several "
                                           f"dtypes; load the weights with --finetune")
            flat = next(iter(by_dtype.values()))
            shared = [shared_embedding and k.split(":", 1)[-1] in
                      ("embedding.word_embeddings.weight", "output_layer.weight") for k, _ in params]
            ranges, total = flat_ranges([t.numel() for _, t in params], size, shared)
            if total != int(flat["numel_unpadded"]):
                raise ckpt.CheckpointError(
                    f"{path}: grad buffer {g} holds {int(flat['numel_unpadded'])} values, the "
                    f"model's parameters at bucket size {size} lay out {total}; check "
                    f"--ddp-bucket-size / --overlap-grad-reduce in its args, or --finetune")
            for (key, t), (a, b) in zip(params, ranges):
                moments = {n: flat[n][a:b].view(t.shape) for n in _KEYS[1:]}
                if step is not None:
                    moments["step"] = torch.tensor(float(step))
                out[key] = (moments, flat["param"][a:b].view(t.shape))
    return out
