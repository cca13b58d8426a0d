"""Collectives on flat tensors, with fallbacks for backends that lack the fused forms.

NCCL has reduce-scatter and all-gather into one contiguous tensor. Older gloo builds lack
reduce-scatter (torch 2.13's gloo has both); where a fused collective is missing we fall back
to all_reduce + slice (reduce-scatter) or `dist.all_gather` into a list (all-gather). The probe
runs once per backend: a missing collective fails the same way on every rank, so every rank
takes the same path and nothing deadlocks.

Every function returns a `Pending` whose `wait()` completes the operation (and runs the
fallback's copy-out), so callers can overlap communication with computation uniformly.
A group of None means a group of one: the collective is the identity.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_SUPPORT: dict[tuple[str, str], bool] = {}  # (backend, collective) -> fused form works

# torch >= 2.10 renamed the fused collectives; the old names still work but warn.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """A launched collective; `wait()` blocks until it is done and its output is in place."""

    def __init__(self, work=None, then: Callable[[], None] | None = None):
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _backend(group) -> str:
    return str(dist.get_backend(group))


def _try_fused(name: str, fn, output, input, group, async_op: bool) -> Pending | None:
    """Run the fused collective, or return None (remembered per backend) if it is missing."""
    key = (_backend(group), name)
    if not _SUPPORT.get(key, True):
        return None
    try:
        return Pending(fn(output, input, group=group, async_op=async_op))
    except (RuntimeError, NotImplementedError) as exc:
        _SUPPORT[key] = False
        logger.info("backend %s has no fused %s (%s); using the fallback", key[0], name, exc)
        return None


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = True) -> Pending:
    if group is None:
        return Pending()
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Pending(work if async_op else None)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group,
                   async_op: bool = True) -> Pending:
    """Sum `input` (numel = size * output.numel()) over the group; rank r keeps chunk r."""
    if group is None:
        output.copy_(input)
        return Pending()
    fused = _try_fused("reduce_scatter", _REDUCE_SCATTER, output, input, group, async_op)
    if fused is not None:
        return fused
    # Fallback: all-reduce a copy (the caller's input may be a live buffer) and keep my chunk.
    rank, n = dist.get_rank(group), output.numel()
    scratch = input.clone()
    work = dist.all_reduce(scratch, group=group, async_op=async_op)
    return Pending(work, lambda: output.copy_(scratch[rank * n:(rank + 1) * n]))


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True) -> Pending:
    """Concatenate every rank's `input` into `output` (rank order)."""
    if group is None:
        output.copy_(input)
        return Pending()
    fused = _try_fused("all_gather", _ALL_GATHER, output, input, group, async_op)
    if fused is not None:
        return fused
    chunks = list(output.chunk(group_size(group)))
    # dist.all_gather writes into the list's tensors; chunks of a contiguous 1-D output are
    # contiguous views, so the result lands in `output` directly.
    return Pending(dist.all_gather(chunks, input, group=group, async_op=async_op))
