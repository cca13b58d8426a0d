"""The tensor-parallel feed-forward block: plain (GELU: GPT, BLOOM) or gated (SwiGLU: Llama;
GeGLU: Gemma), the activation a kind of models/spec.py ACTIVATIONS."""
from __future__ import annotations

import torch
from torch import nn

from megazoo.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, StridedLayout
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .spec import ACTIVATIONS, lookup


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))). Gated (Shazeer 2020): fc1 is the fused [gate; up] projection, stored
    full as [gate; up] and sharded so each rank holds [gate_i; up_i]: the product stays local.
    `activation` overrides the config's (a layer spec's MLP activation)."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str, activation: str | None = None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.activation = lookup(ACTIVATIONS, activation or config.activation, "activation")
        self.act = self.activation.bind(config)
        gated = self.activation.gated
        self.fc1 = ColumnParallelLinear(h, 2 * f if gated else f, topo,
                                        init.normal(prefix + "fc1.weight"), bias=config.bias,
                                        dtype=config.dtype,
                                        layout=StridedLayout(2) if gated else None)
        self.fc2 = RowParallelLinear(f, h, topo, init.scaled_normal(prefix + "fc2.weight"),
                                     bias=config.bias, dtype=config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.activation.gated:
            return self.fc2(self.act(*y.chunk(2, dim=-1)))
        return self.fc2(self.act(y))
