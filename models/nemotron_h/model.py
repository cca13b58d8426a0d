"""Nemotron-H: a stack of single-mixer layers, x + mixer(rmsnorm(x)), each mixer one of Mamba-2
(`linear_attention`, "M" in hybrid_override_pattern), softmax attention without positions
(`full_attention`, "*"), or a squared-ReLU MLP (`mlp`, "-"). Module names are transformers'
`NemotronHForCausalLM`'s (model.embeddings, model.layers.N.norm / .mixer, model.norm_f, lm_head).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..hybrid_cache import HybridCache, causal_self_attention, document_starts
from ..mamba2 import Mamba2Mixer, Mamba2Shape

LAYER_TYPES = ("linear_attention", "full_attention", "mlp")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int = 4
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    chunk_size: int = 128
    recorded: dict = field(default_factory=dict, compare=False)  # fields that leave the math alone

    @property
    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(self.hidden_size, self.mamba_num_heads, self.mamba_head_dim,
                           self.ssm_state_size, self.n_groups, self.conv_kernel,
                           self.layer_norm_epsilon, self.chunk_size, self.time_step_min,
                           self.use_conv_bias, self.use_bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: NemotronHConfig):
        super().__init__()
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(c.hidden_size, h * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=c.attention_bias)

    def forward(self, x, cache, layer, document_ids=None, resets=None):
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = (p(x).view(b, t, -1, d).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = causal_self_attention(q, k, v, d ** -0.5, cache, layer, document_ids)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: NemotronHConfig):
        super().__init__()
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x, cache=None, layer=None, document_ids=None, resets=None):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class Mamba(Mamba2Mixer):
    """Mamba-2 on [b, t, hidden], its state in the cache."""

    def forward(self, x, cache: HybridCache | None, layer: int, document_ids=None, resets=None):
        state = None if cache is None else cache.linear.get(layer)
        y, state = super().forward(x.transpose(0, 1), state, resets)
        if cache is not None:
            cache.linear[layer] = state
        return y.transpose(0, 1)


class Block(nn.Module):
    def __init__(self, c: NemotronHConfig, kind: str):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon)
        self.mixer = {"linear_attention": lambda: Mamba(c.mamba_shape),
                      "full_attention": lambda: Attention(c), "mlp": lambda: MLP(c)}[kind]()

    def forward(self, x, cache, layer, document_ids=None, resets=None):
        return x + self.mixer(self.norm(x), cache, layer, document_ids, resets)


class Backbone(nn.Module):
    def __init__(self, c: NemotronHConfig):
        super().__init__()
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, k) for k in c.layer_types)
        self.norm_f = RMSNorm(c.hidden_size, c.layer_norm_epsilon)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, t] -> logits [b, t, vocab] (continuing `cache`'s sequence if given).
        `document_ids` [b, t]: packed documents, each on its own."""
        x = self.model.embeddings(input_ids)
        resets, _ = document_starts(document_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cache, i, document_ids, resets)
        if cache is not None:
            cache.offset += input_ids.shape[1]
        return self.lm_head(self.model.norm_f(x))
