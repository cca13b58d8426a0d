"""Global gradient norm across TP, PP and DP, and the clipping coefficient.

Each rank sums the squares of the gradients it owns: its shard of every bucket under ZeRO-1/2/3
(shards partition the bucket, so the DP sum covers it once), or the full bucket under stage 0
(every DP rank holds the same reduced gradient, so no DP sum). Buckets whose key is not
`counted` hold duplicates (replicated parameters on TP ranks > 0, the tied embedding on the
last stage) and are skipped. The model-parallel sum then covers TP and PP.
"""
from __future__ import annotations

import math

import torch

from . import collectives as C
from .flat_buffer import FlatBuffer


def global_grad_norm(buffers: list[FlatBuffer], *, sharded: bool, dp_group, mp_group,
                     device: torch.device) -> float:
    """The L2 norm of the (still loss-scaled) gradients; inf or NaN when any gradient is."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for b in buffers:
        if b.key.counted and b.numel:
            sq += torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32).square()
    if sharded:
        C.all_reduce(sq, dp_group, async_op=False)
    C.all_reduce(sq, mp_group, async_op=False)
    return math.sqrt(sq.item()) if math.isfinite(sq.item()) else sq.item()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: scale down only when the norm exceeds max_norm."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
