"""Who holds which tokens under context parallelism: the sequence of every sample split over the
`cp` ranks of a context group.

The one rule (Megatron-core's load balancing for causal attention): the sequence is cut into 2C
equal chunks and context rank r holds chunks r and 2C-1-r, in that order, so every rank has as
many early (cheap) as late (expensive) queries and none idles in the ring. `local_positions` is
that rule; the data (`split_sequence`), the position embeddings (`sequence_positions`) and both
attention modes (parallel/context_parallel.py) derive from it. Packed documents (`Documents`)
keep their ids for the whole sequence on every rank, so both attention modes know the documents
of the keys they meet without sending them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .topology import ParallelTopology


def local_positions(local_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Absolute positions of the `local_length` tokens context rank `cp_rank` holds."""
    if cp == 1:
        return torch.arange(local_length, device=device)
    if local_length % 2:
        raise ValueError(f"a context-parallel share of {local_length} tokens cannot be split into "
                         f"two chunks; --seq-length must be divisible by 2 x --context-parallel-size")
    c = local_length // 2
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def split_sequence(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This context rank's tokens of a full-sequence tensor (e.g. tokens, labels [b, s]: dim 1)."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2 x "
                         f"--context-parallel-size {cp}")
    index = local_positions(x.shape[dim] // cp, cp, cp_rank, x.device)
    return x.index_select(dim, index)


def sequence_positions(length: int, topo: ParallelTopology, offset: int = 0,
                       device=None) -> torch.Tensor:
    """Positions of the `length` tokens this rank holds (after `offset` cached ones; a KV
    cache exists only without context parallelism, see TransformerLanguageModel.forward)."""
    if topo.cp == 1:
        return torch.arange(offset, offset + length, device=device)
    return local_positions(length, topo.cp, topo.cp_rank, device)


@dataclass(frozen=True)
class Documents:
    """The packed documents of a microbatch (--reset-attention-mask, --reset-position-ids).

    `ids` [b, s]: each token's document over the whole sequence, on every context rank (a rank's
    queries meet every rank's keys); None: attention crosses documents. `positions` [b, s/cp]:
    this rank's tokens' positions (restarting per document); None: positions in the sample.
    """
    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def local_ids(self, topo: ParallelTopology) -> torch.Tensor | None:
        """The document ids of this context rank's tokens."""
        return None if self.ids is None else split_sequence(self.ids, 1, topo.cp, topo.cp_rank)
