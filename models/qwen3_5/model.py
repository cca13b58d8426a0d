"""Qwen3.5 (text) and the dense layers of Qwen3-Next: layers of Gated DeltaNet (`linear_attention`)
and gated softmax attention (`full_attention`), each followed by a SwiGLU MLP; RMSNorms with a
zero-centred weight (x * (1 + w)); the module names are transformers' `Qwen3_5ForCausalLM`'s, so
its state dict loads as is.

Gated attention: q_proj gives, per head, [query | gate] (2 x head_dim); queries and keys get a
zero-centred RMSNorm over head_dim, then RoPE on their first head_dim x partial_rotary_factor
channels ([first half | second half] rotation); the output is multiplied by sigmoid(gate)
before o_proj. Text positions only (the three multimodal position components are equal, so
mrope's sections give the plain rotation).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
from ..hybrid_cache import HybridCache, causal_self_attention, document_starts

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    chunk_size: int = 64  # the chunked delta rule's chunk (no HF field: it does not change the math)
    extra: dict = field(default_factory=dict, compare=False)  # token ids and rope extras, for export

    @property
    def linear_shape(self) -> GatedDeltaNetShape:
        return GatedDeltaNetShape(self.hidden_size, self.linear_num_key_heads,
                                  self.linear_num_value_heads, self.linear_key_head_dim,
                                  self.linear_value_head_dim, self.linear_conv_kernel_dim,
                                  self.rms_norm_eps, self.chunk_size)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] channels of x [b, h, s, d]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.c = c
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, 2 * h * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=c.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(d, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, document_ids=None):
        b, t, _ = x.shape
        d = self.c.head_dim
        q, gate = self.q_proj(x).view(b, t, -1, 2 * d).chunk(2, dim=-1)
        q = rotate(self.q_norm(q).transpose(1, 2), cos, sin)
        k = rotate(self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        o = causal_self_attention(q, k, v, d ** -0.5, cache, layer, document_ids)
        o = o.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(b, t, -1)))


class LinearAttention(GatedDeltaNet):
    """Gated DeltaNet on [b, t, hidden], its state in the cache."""

    def forward(self, x, cache: HybridCache | None, layer: int, resets=None):
        state = None if cache is None else cache.linear.get(layer)
        y, state = super().forward(x.transpose(0, 1), state, resets)
        if cache is not None:
            cache.linear[layer] = state
        return y.transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, c: Qwen35Config, size: int | None = None):
        super().__init__()
        size = c.intermediate_size if size is None else size
        self.gate_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35Config, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = LinearAttention(c.linear_shape)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, document_ids=None, resets=None):
        h = self.input_layernorm(x)
        h = (self.linear_attn(h, cache, layer, resets) if self.kind == "linear_attention"
             else self.self_attn(h, cos, sin, cache, layer, document_ids))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, k) for k in c.layer_types)
        self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = c = config
        self.model = Backbone(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        dim = int(c.head_dim * c.partial_rotary_factor)
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float) / dim)), persistent=False)

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, t] -> logits [b, t, vocab] (continuing `cache`'s sequence if given).
        `document_ids` [b, t]: packed documents, each on its own (positions from 0, attention
        within it, linear states reset at its start)."""
        offset = 0 if cache is None else cache.offset
        x = self.model.embed_tokens(input_ids)
        resets, positions = document_starts(document_ids)
        if positions is None:
            pos = torch.arange(offset, offset + input_ids.shape[1], device=x.device).float()
        else:
            pos = positions[:, None].float()  # [b, 1 (heads), t]
        freqs = pos[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, document_ids, resets)
        if cache is not None:
            cache.offset += input_ids.shape[1]
        return self.lm_head(self.model.norm(x))
