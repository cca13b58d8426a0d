"""Autograd-aware collectives for tensor and sequence parallelism (Megatron's "mappings").

Each function is a pair of conjugate operations: what the forward does on activations, the
backward does (transposed) on gradients. Over a group of size 1 (`collectives.SINGLE`) all are
identities, so unsharded models run through the same code. The raw collectives they are built from live
in `parallel/collectives.py`.

    copy_to_tp            fwd identity          bwd all-reduce       (enter a column-parallel region)
    reduce_from_tp        fwd all-reduce        bwd identity         (leave a row-parallel region)
    gather_last_dim       fwd all-gather (-1)   bwd split (-1)
    scatter_to_sequence   fwd split (dim 0)     bwd all-gather (0)
    gather_from_sequence  fwd all-gather (0)    bwd reduce-scatter (0)
    reduce_scatter_to_sequence  fwd reduce-scatter (0)  bwd all-gather (0)
    gather_sequence_replicated  fwd all-gather (0)  bwd split (0)   (every TP rank then repeats
                                                                  the same computation: MoE)
    all_to_all(x, g, s, t)  fwd scatter dim s, gather dim t   bwd scatter t, gather s   (Ulysses)
    all_to_all_rows(x, g, out, in)  fwd rows in uneven splits   bwd the splits swapped (MoE)

Activations are laid out [sequence, batch, hidden], so the sequence dimension is dim 0.
"""
from __future__ import annotations

import torch

from . import collectives as C
from .collectives import all_gather, all_reduce, group_size, reduce_scatter, split


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


class _GatherSplit(torch.autograd.Function):
    """fwd all-gather along `dim`, bwd split along `dim` (the gathered tensor feeds a computation
    every rank repeats, so each rank's gradient of it is whole: keep the own chunk, no sum)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.group, dim=ctx.dim), None, None


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


class _AllToAll(torch.autograd.Function):
    """An all-to-all whose backward is the same exchange reversed. `how` is (raw collective, a, b)
    with `C.all_to_all` (a, b = scatter, gather dim) or `C.all_to_all_rows` (a, b = output,
    input splits); the reverse swaps a and b."""

    @staticmethod
    def forward(ctx, x, group, how):
        ctx.group, ctx.how = group, how
        exchange, a, b = how
        return exchange(x, group, a, b)

    @staticmethod
    def backward(ctx, g):
        exchange, a, b = ctx.how
        return exchange(g, ctx.group, b, a), None, None


def _apply(fn, x, group):
    return x if group_size(group) == 1 else fn.apply(x, group)


def copy_to_tp(x, group):
    return _apply(_CopyToTP, x, group)


def reduce_from_tp(x, group):
    return _apply(_ReduceFromTP, x, group)


def gather_last_dim(x, group):
    return x if group_size(group) == 1 else _GatherSplit.apply(x, group, -1)


def scatter_to_sequence(x, group):
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence(x, group):
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence(x, group):
    return _apply(_ReduceScatterToSequence, x, group)


def gather_sequence_replicated(x, group):
    return x if group_size(group) == 1 else _GatherSplit.apply(x, group, 0)


def all_to_all(x, group, scatter_dim: int, gather_dim: int):
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, (C.all_to_all, scatter_dim, gather_dim))


def all_to_all_rows(x, group, output_splits: list[int], input_splits: list[int]):
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, (C.all_to_all_rows, output_splits, input_splits))
