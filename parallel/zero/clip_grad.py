"""Global gradient norm across TP, PP and DP, and the clipping coefficient.

Each rank sums the squares of the gradients it owns: its shard of every bucket under ZeRO-1/2/3
(shards partition the bucket, so the DP sum covers it once), or the full bucket under stage 0
(every DP rank holds the same reduced gradient, so no DP sum). MoE expert buckets are sharded
over expert data parallelism, so the DP sum (expert-parallel x expert-data-parallel ranks) covers
every expert once too; under stage 0 their squares are summed over the expert-parallel group. Buckets whose key is not
`counted` hold duplicates (replicated parameters on TP ranks > 0, the tied embedding on the
last stage) and are skipped; so are rows that a TP rank holds as a copy of another rank's
(key/value heads replicated when tp > KV heads, see `duplicate_ranges`). The model-parallel sum
then covers TP and PP.
"""
from __future__ import annotations

import math

import torch

from .. import collectives as C
from megazoo.parallel.tensor_parallel import duplicate_rows

from .flat_buffer import FlatBuffer


def duplicate_ranges(b: FlatBuffer, topo) -> list[tuple[int, int]]:
    """[start, end) ranges of `b.grad_shard` holding rows another TP rank counts instead."""
    out = []
    for slot, lo, hi in b.shard_ranges():
        rows = duplicate_rows(slot.param, topo)
        if rows:
            start = slot.offset + slot.numel - rows * (slot.numel // slot.param.shape[0])
            s, e = max(lo, start), hi
            if s < e:
                out.append((s - b.shard_start, e - b.shard_start))
    return out


def global_grad_norm(buffers: list[FlatBuffer], *, sharded: bool, dp_group, mp_group,
                     device: torch.device, exclude: dict[int, list[tuple[int, int]]] | None = None,
                     ep_group=None) -> float:
    """The L2 norm of the (still loss-scaled) gradients; inf or NaN when any gradient is.

    `exclude`: per buffer index, shard ranges left out (from `duplicate_ranges`)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    for i, b in enumerate(buffers):
        if b.key.counted and b.numel:
            part = experts if b.key.expert else sq
            part += torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32).square()
            for s, e in (exclude or {}).get(i, ()):
                part -= torch.linalg.vector_norm(b.grad_shard[s:e], dtype=torch.float32).square()
    if not sharded:
        C.all_reduce(experts, ep_group)
    sq += experts
    if sharded:
        C.all_reduce(sq, dp_group)
    C.all_reduce(sq, mp_group)
    return math.sqrt(sq.item()) if math.isfinite(sq.item()) else sq.item()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: scale down only when the norm exceeds max_norm."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
