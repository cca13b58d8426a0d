"""Context parallelism for linear token mixers (Gated DeltaNet, Mamba-2) by heads, as Megatron-core
runs Mamba under context parallelism: one all-to-all turns this rank's share of the sequence for
all of its heads into the whole sequence for a cp-th of them, the causal conv and the recurrence
run over the whole sequence with no state passed between ranks, and a second all-to-all gives
each rank its own tokens back, for all heads. All cp ranks of a layer work at once.

megazoo's load-balanced split (parallel/context_split.py: rank r holds chunks r and 2 cp - 1 - r)
arrives in context-rank order; it is put in sequence order before the scan and back after it.

What travels is described per segment of the features (`Segment`: its width on this tensor-
parallel rank and how many cp ranks share each of its groups). A segment of G groups (key heads,
Mamba groups) with cp dividing G is cut into cp parts; with G dividing cp each group is repeated
cp / G times so that cp / G consecutive ranks each get it, with their own share of the heads it
serves (Megatron-core's group replication). `HeadPart.take` cuts a parameter (conv weight and
bias, A_log, dt_bias, D) the same way, in forward, so each rank's gradient lands on its slice of
the whole parameter (the rest zero) and the data-parallel x context-parallel gradient sum adds
the ranks' slices.

When the heads do not split (`head_split_problem`), the layer keeps the state-passing chain
(parallel/state_passing.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .collectives import group_rank, group_size
from .context_split import local_positions
from .mappings import all_to_all_rows


class Segment(NamedTuple):
    """`width` features on this tensor-parallel rank, in `groups` equal groups (heads, key heads,
    Mamba groups) kept whole on a cp rank; 0 groups: not sent (`sequence_to_heads`)."""
    width: int
    groups: int

    def replicas(self, cp: int) -> int:
        """How many cp ranks share each group (1: the groups are divided among the ranks)."""
        return 1 if self.groups % cp == 0 else cp // self.groups


def head_split_problem(counts: dict, tp: int, cp: int) -> str | None:
    """Why the heads of a linear layer cannot be split over `cp` context ranks (None: they can).
    `counts`: what -> (heads, groups): the heads must divide by tp x cp; their groups (key heads,
    Mamba groups) too, or the groups per TP rank must divide cp (each group then repeated)."""
    for what, (heads, groups) in counts.items():
        if (heads // tp) % cp:
            return (f"its {heads} {what} over --tensor-model-parallel-size {tp} x "
                    f"--context-parallel-size {cp} do not divide")
        per_tp = groups // tp
        if not per_tp or (per_tp % cp and cp % per_tp):
            return (f"its {groups // tp} groups of {what} per tensor-parallel rank and "
                    f"--context-parallel-size {cp}: neither divides the other")
    return None


@dataclass(frozen=True)
class HeadPart:
    """Context rank `rank` of `size`: which share of each segment it runs."""
    rank: int
    size: int

    def take(self, t: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """This rank's rows of `t` (dim 0 laid out as `segments`, e.g. a conv weight)."""
        parts = []
        for piece, seg in zip(t.split([s.width for s in segments]), segments):
            r = seg.replicas(self.size)
            parts.append(piece.chunk(self.size // r)[self.rank // r])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def width(self, seg: Segment) -> int:
        return seg.width * seg.replicas(self.size) // self.size


def _gathered_order(local_length: int, cp: int, device) -> torch.Tensor:
    """The sequence position of each gathered token (gathered: context-rank order)."""
    return torch.cat([local_positions(local_length, cp, r, device) for r in range(cp)])


def sequence_to_heads(x: torch.Tensor, segments: list[Segment], group) -> torch.Tensor:
    """x [2c, b, features] (this rank's tokens, features laid out as `segments`; a segment of
    0 groups stays here: the output gate, applied after the scan) -> [2c cp, b, this rank's share of every segment], in sequence order."""
    cp, n = group_size(group), x.shape[0]
    parts = []
    for piece, seg in zip(x.split([s.width for s in segments], dim=-1), segments):
        if seg.groups:
            r = seg.replicas(cp)
            piece = piece.reshape(n, x.shape[1], cp // r, -1)
            parts.append(piece.repeat_interleave(r, dim=2) if r > 1 else piece)
    send = torch.cat(parts, dim=-1).permute(2, 0, 1, 3).reshape(cp * n, x.shape[1], -1)
    got = all_to_all_rows(send, group, [n] * cp, [n] * cp)
    return got.index_select(0, torch.argsort(_gathered_order(n, cp, x.device)))


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """y [s, b, f] (the whole sequence for this rank's heads) -> [s / cp, b, cp f]: this rank's
    tokens (load-balanced split) for every rank's heads, in rank (= head) order."""
    cp = group_size(group)
    n = y.shape[0] // cp
    send = y.index_select(0, _gathered_order(n, cp, y.device))
    got = all_to_all_rows(send, group, [n] * cp, [n] * cp)
    return got.reshape(cp, n, y.shape[1], -1).permute(1, 2, 0, 3).reshape(n, y.shape[1], -1)


def context_heads(scan, x: torch.Tensor, segments: list[Segment], group,
                  resets: torch.Tensor | None = None) -> torch.Tensor:
    """A linear recurrence over megazoo's load-balanced context split, by heads:
    `scan(features, None, resets, part) -> (y [s, b, f], final state)` runs `part`'s heads over
    the whole sequence (features as `sequence_to_heads` gives them); `resets` [b, s]: packed
    documents' first tokens over the whole sequence. x [2c, b, ...] is this rank's tokens;
    returns this rank's outputs [2c, b, cp f] for all of its tensor-parallel rank's heads."""
    part = HeadPart(group_rank(group), group_size(group))
    y, _ = scan(sequence_to_heads(x, segments, group), None, resets, part)
    return heads_to_sequence(y, group)
