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


def causal_self_attention(q, k, v, scale: float, cache: HybridCache | None, layer: int):
    """Causal attention of q [b, h, s, d] over k, v [b, kv, s, d], through the cache if any."""
    if cache is None:
        return attention(q, k, v, causal=True, scale=scale)
    return cache.attend(layer, q, k, v, scale)


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
