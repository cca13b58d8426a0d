"""Autograd-aware collectives for tensor and sequence parallelism (Megatron's "mappings").

Each function is a pair of conjugate operations: what the forward does on activations, the
backward does (transposed) on gradients. With a group of size 1 (or None) all are identities,
so unsharded models run through the same code.

    copy_to_tp            fwd identity          bwd all-reduce       (enter a column-parallel region)
    reduce_from_tp        fwd all-reduce        bwd identity         (leave a row-parallel region)
    gather_last_dim       fwd all-gather (-1)   bwd split (-1)
    scatter_to_sequence   fwd split (dim 0)     bwd all-gather (0)
    gather_from_sequence  fwd all-gather (0)    bwd reduce-scatter (0)
    reduce_scatter_to_sequence  fwd reduce-scatter (0)  bwd all-gather (0)

Activations are laid out [sequence, batch, hidden], so the sequence dimension is dim 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C


group_size = C.group_size


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (in group-rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out.view(-1), x.view(-1), group, async_op=False).wait()  # dim-0 chunks are flat ranges
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's chunk along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter(out.view(-1), x.view(-1), group, async_op=False).wait()
    return out.movedim(0, dim)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


# ---- autograd functions -------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.group, dim=-1), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, dim=0)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, dim=0), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, g):
        # Each rank's gradient w.r.t. the gathered tensor is a partial sum (it used only its own
        # weight shard): sum them and hand each rank its sequence chunk.
        return reduce_scatter(g, ctx.group, dim=0), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, dim=0), None


def _apply(fn, x, group):
    return x if group_size(group) == 1 else fn.apply(x, group)


def copy_to_tp(x, group):
    return _apply(_CopyToTP, x, group)


def reduce_from_tp(x, group):
    return _apply(_ReduceFromTP, x, group)


def gather_last_dim(x, group):
    return _apply(_GatherLastDim, x, group)


def scatter_to_sequence(x, group):
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence(x, group):
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence(x, group):
    return _apply(_ReduceScatterToSequence, x, group)
