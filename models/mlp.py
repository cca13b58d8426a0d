"""The tensor-parallel feed-forward block: GELU (GPT, BLOOM) or SwiGLU (Llama)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, StridedLayout
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))). With SwiGLU (Shazeer 2020) fc1 is the fused [gate; up] projection, stored
    full as [gate; up] and sharded so each rank holds [gate_i; up_i]: the product stays local."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer, prefix: str):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.swiglu = config.activation == "swiglu"
        self.fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, topo,
                                        init.normal(prefix + "fc1.weight"), bias=config.bias,
                                        dtype=config.dtype,
                                        layout=StridedLayout(2) if self.swiglu else None)
        self.fc2 = RowParallelLinear(f, h, topo, init.scaled_normal(prefix + "fc2.weight"),
                                     bias=config.bias, dtype=config.dtype)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(y, approximate=self.approximate))
