"""LayerNorm and RMSNorm whose replicated weights work under sequence parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.mappings import copy_to_tp
from megazoo.parallel.tensor_parallel import sequence_parallel_param
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig


class LayerNorm(nn.Module):
    """LayerNorm whose replicated weights see a sequence shard under sequence parallelism."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True):
        super().__init__()
        h = config.hidden_size
        self.eps, self.topo, self.in_sequence_region = config.layernorm_epsilon, topo, in_sequence_region
        self.weight = nn.Parameter(torch.ones(h, device=topo.device, dtype=config.dtype))
        self.bias = nn.Parameter(torch.zeros(h, device=topo.device, dtype=config.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.in_sequence_region:
            w, b = sequence_parallel_param(w, self.topo), sequence_parallel_param(b, self.topo)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), computed in fp32 and cast back before the
    weight, as Llama and HF do; same sequence-parallel gradient handling as LayerNorm.

    `size`/`over_tp_heads` make Qwen3's per-head q/k norm: one [head_dim] weight for all heads;
    each TP rank normalises other heads, so the weight's gradient is summed over TP."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True,
                 size: int | None = None, over_tp_heads: bool = False):
        super().__init__()
        self.eps, self.topo, self.in_sequence_region = config.layernorm_epsilon, topo, in_sequence_region
        self.over_tp_heads = over_tp_heads and topo.tp > 1
        self.weight = nn.Parameter(torch.ones(size or config.hidden_size, device=topo.device,
                                              dtype=config.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sequence_parallel_param(self.weight, self.topo) if self.in_sequence_region else self.weight
        if self.over_tp_heads:
            w = copy_to_tp(w, self.topo.tp_group)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * normed.to(x.dtype)


def build_norm(config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True) -> nn.Module:
    cls = RMSNorm if config.normalization == "rmsnorm" else LayerNorm
    return cls(config, topo, in_sequence_region=in_sequence_region)
