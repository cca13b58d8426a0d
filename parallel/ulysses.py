"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): `--cp-comm-type a2a`.

One all-to-all turns this rank's [b, heads, s/C, d] into [b, heads/C, s, d]: every rank then
holds the whole sequence for a C-th of the heads, attends exactly as without context
parallelism, and a second all-to-all gives the sequence back. The gathered sequence arrives in
context-rank order (chunks 0, 2C-1, 1, 2C-2, ...: `local_positions`), so it is put in position
order for the attention and back afterwards. Heads and key/value heads per TP rank must both be
divisible by C (`ParallelConfig.check_model` refuses other layouts), so each rank keeps whole
query groups with their key/value head.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import collectives as C
from .context_split import local_positions
from .mappings import all_to_all


def _order(local_length: int, cp: int, device) -> torch.Tensor:
    """Position of each gathered token (gathered order is context-rank order)."""
    return torch.cat([local_positions(local_length, cp, r, device) for r in range(cp)])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo,
                      alibi_slopes: torch.Tensor | None, attend: Callable,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the context group's whole sequence (shapes: `context_attention`);
    `attend(q, k, v, alibi_slopes=...)` is single-device causal attention over a whole
    sequence (`parallel.kernels.attention.attention`)."""
    group = topo.cp_group
    cp, rank = C.group_size(group), C.group_rank(group)
    n = q.shape[2]  # heads divisible by cp: ParallelConfig.check_model
    positions = _order(n, cp, q.device)
    natural = torch.argsort(positions)
    q, k, v = (all_to_all(t, group, 1, 2).index_select(2, natural) for t in (q, k, v))
    slopes = None if alibi_slopes is None else alibi_slopes.reshape(cp, -1)[rank]
    # after the all-to-all a rank holds the whole sequence in natural order: the ids as given
    out = attend(q, k, v, alibi_slopes=slopes, q_document_ids=document_ids)
    return all_to_all(out.index_select(2, positions), group, 2, 1)
