"""Expert parallelism: which experts a rank holds, and moving tokens to them and back.

The `ep` ranks of an expert-parallel group (carved out of data parallelism, see layout.py) each
hold `num_experts / ep` consecutive experts of every MoE layer. A rank routes its own tokens,
sorts the (token, expert) assignments by expert and then

    dispatch   all-to-all the assignments to the ranks holding their experts; the received rows
               (grouped by source rank, then expert) are reordered expert-major, so the local
               experts run as one grouped matmul
    combine    the inverse reorder and the inverse all-to-all bring the expert outputs home

Both are autograd-aware: the backward of an all-to-all is the all-to-all with the splits swapped.
With ep = 1 (`collectives.SINGLE`) both are identities, so the unsharded model runs the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import collectives as C
from .mappings import all_to_all_rows
from .topology import ParallelTopology


def ep_rank(topo: ParallelTopology) -> int:
    """This rank's position in its expert-parallel group."""
    return topo.group_ranks.get("ep", [topo.rank]).index(topo.rank)


def local_experts(num_experts: int, topo: ParallelTopology) -> range:
    """Global indices of the experts this rank holds (consecutive blocks, Megatron's order)."""
    n = num_experts // topo.ep
    start = ep_rank(topo) * n
    return range(start, start + n)


@dataclass
class Dispatched:
    """What `combine` needs to undo a `dispatch`."""

    order: torch.Tensor | None  # expert-major row j is received row order[j] (None: ep = 1)
    output_splits: list[int]  # rows this rank sent to each rank (it gets as many back)
    input_splits: list[int]  # rows it received from each rank


class TokenDispatcher:
    """The token dispatch of one MoE layer: its (token, expert) assignments sorted by expert
    (those over an expert's capacity dropped), sent to the ranks of the expert-parallel `group`
    holding their experts, and the expert outputs brought back.

    Only two steps have data-dependent shapes, and each is one method: `keep` (which sorted
    assignments fit the capacity) and `exchange_counts` (the rows every rank sends to every
    other, read on the host for the all-to-all). The dry run on meta tensors replaces these two
    with balanced routing's (training/planning/meta_kernels.py); the rest runs as it is."""

    def __init__(self, group):
        self.group = group

    def sort(self, flat: torch.Tensor, counts: torch.Tensor, capacity: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, kept counts): the assignments `flat` [T * k] (expert per assignment, `counts`
        per expert) sorted by expert, tokens in order within one, keeping each expert's first
        `capacity` (GShard's position order; None: all)."""
        order = torch.argsort(flat, stable=True)
        if capacity is None:
            return order, counts
        position = torch.arange(flat.numel(), device=flat.device) - \
            (counts.cumsum(0) - counts)[flat[order]]
        return self.keep(order, position < capacity, counts, capacity), counts.clamp(max=capacity)

    def keep(self, order: torch.Tensor, fits: torch.Tensor, counts: torch.Tensor,
             capacity: int) -> torch.Tensor:
        """The sorted assignments within their expert's capacity."""
        return order[fits]

    def exchange_counts(self, counts: torch.Tensor, rows: int
                        ) -> tuple[torch.Tensor, list[int], list[int]]:
        """(rows each rank sends me for each of my experts [ep (source), local experts], rows I
        send to each rank, rows I receive from each rank) for my `counts` per global expert
        (`rows` of them in all)."""
        ep = C.group_size(self.group)
        local = counts.numel() // ep
        received = C.all_to_all_rows(counts.view(ep, local), self.group, [1] * ep, [1] * ep)
        return received, counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                      Dispatched]:
        """Send rows `x` (sorted by global expert; `counts[e]` rows for expert e) to the ranks
        holding their experts. Returns (rows for my experts sorted expert-major, rows per local
        expert, handle for `combine`)."""
        ep = C.group_size(self.group)
        if ep == 1:
            return x, counts, Dispatched(None, [], [])
        local = counts.numel() // ep
        received, send, recv = self.exchange_counts(counts, x.shape[0])
        rows = all_to_all_rows(x, self.group, recv, send)
        # Rows arrive source-major (source, expert); the grouped matmul wants expert-major.
        label = torch.arange(ep * local, device=x.device).repeat_interleave(
            received.reshape(-1), output_size=sum(recv))  # the size known: no device sync
        key = (label % local) * ep + label // local
        order = torch.argsort(key, stable=True)
        return rows[order], received.sum(0), Dispatched(order, send, recv)

    def combine(self, y: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """The expert outputs back on the ranks (and in the order) their rows came from."""
        if handle.order is None:
            return y
        back = torch.empty_like(handle.order)
        back[handle.order] = torch.arange(handle.order.numel(), device=y.device)
        return all_to_all_rows(y[back], self.group, handle.output_splits, handle.input_splits)


def reduce_expert_load(table: torch.Tensor) -> torch.Tensor:
    """Sum per-layer expert loads [layers, experts] over every rank in place (each pipeline stage
    fills the rows of its layers, zeros elsewhere), so that the expert-bias update is the same on
    all ranks. Every rank calls it."""
    return C.all_reduce(table, C.world())
