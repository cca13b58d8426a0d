"""Generation state of a hybrid model: per layer either a constant-size linear state (conv tail +
recurrent state, models/gated_deltanet.py `LinearState`) or the keys and values of a softmax
attention layer, and greedy decoding over it.
"""
from __future__ import annotations

import torch

from megazoo.parallel.kernels.attention import attention


class HybridCache:
    def __init__(self):
        self.linear: dict[int, object] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.offset = 0  # positions already seen

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        """q [b, h, s, d], k, v [b, kv, s, d] of the new positions; causal attention over the
        cached and new keys (the cache keeps them)."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return attention(q, k, v, causal=True, scale=scale, q_offset=k.shape[2] - q.shape[2])


def causal_self_attention(q, k, v, scale: float, cache: HybridCache | None, layer: int,
                          document_ids: torch.Tensor | None = None):
    """Causal attention of q [b, h, s, d] over k, v [b, kv, s, d], through the cache if any;
    `document_ids` [b, s]: packed documents, each attending to itself only."""
    if cache is None:
        return attention(q, k, v, causal=True, scale=scale, q_document_ids=document_ids)
    if document_ids is not None:
        raise ValueError("packed documents with a generation cache: generate one sequence per row")
    return cache.attend(layer, q, k, v, scale)


def document_starts(document_ids: torch.Tensor | None) -> tuple:
    """(resets [b, s] bool: a token starts a document, positions [b, s]: its index inside its
    document) of packed rows; (None, None) without documents."""
    if document_ids is None:
        return None, None
    resets = torch.ones_like(document_ids, dtype=torch.bool)
    resets[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    start = torch.cummax(torch.where(resets, index, torch.zeros_like(index)), dim=1).values
    return resets, index - start


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of input_ids [b, t]: the prompt once, then one token per step with
    each layer's state (constant size for linear layers) carried in a HybridCache."""
    cache = HybridCache()
    logits = model(input_ids, cache=cache)
    out = [input_ids]
    for _ in range(max_new_tokens):
        nxt = logits[:, -1:].argmax(-1)
        out.append(nxt)
        logits = model(nxt, cache=cache)
    return torch.cat(out, dim=1)
