"""Context parallelism: attention over a sequence split over the `cp` ranks of a context group
(who holds which tokens: parallel/context_split.py).

Attention is the only place where context ranks talk: `context_attention` runs ring attention
(`--cp-comm-type p2p`, parallel/ring_attention.py) or all-to-all attention (`a2a`,
DeepSpeed-Ulysses, parallel/ulysses.py) on this rank's queries, keys and values. Everything
else (embeddings, MLPs, norms, loss) is per token and runs on the local share unchanged; the
loss is a mean over the local tokens, and the gradient reduction over data x context parallel
(ZeRO's `dp_cp` group) averages those means into the full sequence's (with a loss mask, the
per-token loss counts tokens over the group instead: training/run/step.py `per_token_norm`).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .layout import LayoutError
from .ring_attention import ring_attention
from .topology import ParallelTopology
from .ulysses import ulysses_attention

COMM_TYPES = ("p2p", "a2a")  # --cp-comm-type


def check_attention(attention_dropout: float, cp: int) -> None:
    """Refuse what the context-parallel attention does not model (run by the trainer's flag
    checks and by every attention layer)."""
    if cp > 1 and attention_dropout > 0:
        raise LayoutError(f"--attention-dropout {attention_dropout} is not supported with "
                          f"--context-parallel-size {cp} (context-parallel attention has no "
                          f"dropout); set --attention-dropout 0")


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: ParallelTopology,
                      alibi_slopes: torch.Tensor | None, attend: Callable,
                      window: int | None = None,
                      document_ids: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of this context rank's queries over the whole sequence's keys.

    q [b, heads, s_local, d]; k [b, kv_heads, s_local, d], v [b, kv_heads, s_local, dv]
    (grouped-query heads stay grouped; only key/value heads travel; dv may differ from d, as in
    multi-latent attention); alibi_slopes [heads] or None. Returns [b, heads, s_local, dv].
    `attend(q, k, v, slopes, window=, scale=)`: the model's causal attention over one whole
    sequence (a2a mode); `window`: a sliding window (keys window or more positions back hidden).
    `document_ids` [b, s] (the whole sequence, `Documents.ids`): no query sees another document.
    `scale`: the softmax scale; None: 1/sqrt(d).
    """
    if topo.config.cp_comm_type == "a2a":
        attend = functools.partial(attend, window=window, scale=scale)
        return ulysses_attention(q, k, v, topo, alibi_slopes, attend, document_ids)
    return ring_attention(q, k, v, topo.cp_group, alibi_slopes, window, document_ids, scale)
