"""A dense MLP and routed experts side by side in one layer (Gemma 4's MoE block, MLP kind
"dense_moe" of models/spec.py):

    y = norm_d(mlp(norm(x))) + norm_e(experts(norm_x(x), routed on x))

The dense MLP is the layer's ordinary tensor-parallel MLP (its `fc1`/`fc2` and the layer's norm
before it); the experts are models/moe.py's `MoELayer` (router, grouped experts, expert-parallel
dispatch), reading their own pre-norm of the layer's un-normed input while the router reads that
input itself (through its own input norm, `moe_router_input_norm`). Each branch has its own
output norm; the layer's post-MLP norm then follows their sum.
"""
from __future__ import annotations

import torch

from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .mlp import ParallelMLP
from .moe import MoELayer
from .norms import build_norm


class DenseAndExperts(ParallelMLP):
    """`fc1`/`fc2` (the dense MLP, as ParallelMLP), `moe` (router and experts), and three norms:
    after the dense MLP, before and after the experts. Called as (normed input, residual)."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str, activation: str | None = None):
        super().__init__(config, topo, init, prefix, activation)
        self.moe = MoELayer(config, topo, init, prefix + "moe.")
        self.dense_output_norm = build_norm(config, topo)
        self.experts_input_norm = build_norm(config, topo)
        self.experts_output_norm = build_norm(config, topo)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dense = self.dense_output_norm(super().forward(x))
        experts = self.moe(self.experts_input_norm(residual), router_tokens=residual)
        return dense + self.experts_output_norm(experts)
