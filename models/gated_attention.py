"""Qwen3.5 / Qwen3-Next's gated full attention as a token mixer kind ("gated_attention",
models/spec.py): megazoo's softmax attention (fused QKV grouped per key head, q/k norms, the
context-parallel ring / all-to-all) with

- RoPE on the first head_dim x `rotary_fraction` channels of each head ([first half | second
  half] rotation of that part, the default rope type only), the rest left as is;
- an output gate: o * sigmoid(gate(x)) before the output projection, `gate` a column-parallel
  projection to heads x head_dim sharded with the query heads (transformers stores it per head
  after the query in q_proj; the Qwen3.5 adapter splits and re-fuses it).
"""
from __future__ import annotations

import dataclasses

import torch

from megazoo.parallel.context_split import sequence_positions
from megazoo.parallel.random import checkpoint
from megazoo.parallel.tensor_parallel import ColumnParallelLinear

from .attention import ParallelAttention
from .rope import inverse_frequencies, rotate_half


class GatedAttention(ParallelAttention):
    def __init__(self, config, topo, init, prefix, rng, spec):
        if spec.rope_theta is None or spec.rope_scaling:
            raise ValueError("gated_attention layers rotate with the default rope type: set "
                             "position_embedding 'rope' and no rope_scaling")
        super().__init__(config, topo, init, prefix, rng, dataclasses.replace(spec, rope_theta=None))
        heads, d = config.num_attention_heads, config.head_dim
        self.gate = ColumnParallelLinear(config.hidden_size, heads * d, topo,
                                         init.normal(prefix + "gate.weight"), bias=False,
                                         dtype=config.dtype)
        rotated = round(d * config.rotary_fraction)
        self.register_buffer("inv_freq", inverse_frequencies(rotated, spec.rope_theta).to(topo.device),
                             persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = cos.shape[-1]
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def forward(self, x, cache=None, layer: int = 0, documents=None):
        qkv = self.qkv(x)
        s, b, _ = qkv.shape
        g, qg, d = self.groups_local, self.q_per_group_local, self.head_dim
        q, k, v = qkv.view(s, b, g, qg + 2, d).split([qg, 1, 1], dim=3)
        q = q.reshape(s, b, g * qg, d).permute(1, 2, 0, 3)
        k, v = k.squeeze(3).permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = cache.offset if cache is not None else 0
        positions = documents.positions if documents is not None and documents.positions is not None \
            else sequence_positions(s, self.topo, offset)
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb[:, None]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, self.window_of(layer))
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.rng, q, k, v, layer, documents)
        else:
            out = self.core_attention(q, k, v, layer, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * d)
        return self.dense(out * torch.sigmoid(self.gate(x)))
