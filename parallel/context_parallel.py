"""Context parallelism: the sequence of every sample split over the `cp` ranks of a context group.

The one rule for who holds which tokens (Megatron-core's load balancing for causal attention):
the sequence is cut into 2C equal chunks and context rank r holds chunks r and 2C-1-r, in that
order, so every rank has as many early (cheap) as late (expensive) queries and none idles in
the ring. `local_positions` is that rule; the data (`split_sequence`), the position embeddings
(`sequence_positions`) and both attention modes derive from it.

Attention is the only place where context ranks talk: `context_attention` runs ring attention
(`--cp-comm-type p2p`, parallel/ring_attention.py) or all-to-all attention (`a2a`,
DeepSpeed-Ulysses, parallel/ulysses.py) on this rank's queries, keys and values. Everything
else (embeddings, MLPs, norms, loss) is per token and runs on the local share unchanged; the
loss is a mean over the local tokens, and the gradient reduction over data x context parallel
(ZeRO's `dp_cp` group) averages those means into the full sequence's (with a loss mask, the
per-token loss counts tokens over the group instead: training/run/step.py `per_token_norm`).
Packed documents (`Documents`) keep their ids for the whole sequence on every rank, so both
attention modes know the documents of the keys they meet without sending them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .layout import LayoutError
from .topology import ParallelTopology

COMM_TYPES = ("p2p", "a2a")  # --cp-comm-type


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
        from .ulysses import ulysses_attention
        attend = functools.partial(attend, window=window, scale=scale)
        return ulysses_attention(q, k, v, topo, alibi_slopes, attend, document_ids)
    from .ring_attention import ring_attention
    return ring_attention(q, k, v, topo.cp_group, alibi_slopes, window, document_ids, scale)
