"""LayerNorm and RMSNorm whose replicated weights work under sequence parallelism; the kind a
config names (models/spec.py NORMS) picks the class and its options."""
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
    each TP rank normalises other heads, so the weight's gradient is summed over TP.

    `offset` (Gemma): the weight is stored as w, starts at 0 and scales by (1 + w), in fp32 with
    the normalised input, cast back after (as Gemma's RMSNorm)."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True,
                 size: int | None = None, over_tp_heads: bool = False, offset: bool | None = None):
        super().__init__()
        self.eps, self.topo, self.in_sequence_region = config.layernorm_epsilon, topo, in_sequence_region
        self.over_tp_heads = over_tp_heads and topo.tp > 1
        self.offset = config.norm_kind.offset if offset is None else offset
        fill = torch.zeros if self.offset else torch.ones
        self.weight = nn.Parameter(fill(size or config.hidden_size, device=topo.device,
                                        dtype=config.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sequence_parallel_param(self.weight, self.topo) if self.in_sequence_region else self.weight
        if self.over_tp_heads:
            w = copy_to_tp(w, self.topo.tp_group)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + w.float())).to(x.dtype)
        return w * normed.to(x.dtype)


def build_norm(config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True,
               size: int | None = None, over_tp_heads: bool = False) -> nn.Module:
    """The norm of the config's kind (models/spec.py NORMS; an unknown kind is an error):
    over hidden_size, or `size` channels (per-head q/k norms, `over_tp_heads`)."""
    kind = config.norm_kind
    if not kind.rms:
        if size is not None or over_tp_heads:
            raise ValueError(f"normalization {config.normalization!r} has no per-head form; "
                             f"q/k norms need an RMSNorm kind")
        return LayerNorm(config, topo, in_sequence_region=in_sequence_region)
    return RMSNorm(config, topo, in_sequence_region=in_sequence_region, size=size,
                   over_tp_heads=over_tp_heads, offset=kind.offset)
