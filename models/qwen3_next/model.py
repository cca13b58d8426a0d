"""Qwen3-Next: Qwen3.5's layers (Gated DeltaNet and gated attention, models/qwen3_5/model.py) with
a sparse mixture of experts in place of the dense MLP on every `decoder_sparse_step`-th layer
not in `mlp_only_layers`: softmax router, top-k (renormalised with `norm_topk_prob`), SwiGLU
experts stored as transformers' 3-D `gate_up_proj` / `down_proj`, plus a shared SwiGLU expert
scaled by sigmoid(`shared_expert_gate`). Module names are transformers' `Qwen3NextForCausalLM`'s
except the linear layers' fused projections, which the adapter splits (models/qwen3_next/hf.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..qwen3_5.model import MLP, Qwen35Config, Qwen35ForCausalLM


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen35Config):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)


class Router(nn.Module):
    def __init__(self, c: Qwen3NextConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))


class Experts(nn.Module):
    def __init__(self, c: Qwen3NextConfig):
        super().__init__()
        e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * c.initializer_range)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * c.initializer_range)


class SparseMoE(nn.Module):
    def __init__(self, c: Qwen3NextConfig):
        super().__init__()
        self.c = c
        self.gate = Router(c)
        self.experts = Experts(c)
        self.shared_expert = MLP(c, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = probs.topk(self.c.num_experts_per_tok, dim=-1)
        if self.c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(x[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class Qwen3NextForCausalLM(Qwen35ForCausalLM):
    def __init__(self, config: Qwen3NextConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if config.is_moe_layer(i):
                layer.mlp = SparseMoE(config)
