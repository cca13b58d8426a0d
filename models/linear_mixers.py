"""The linear-time token mixers as layer kinds of megazoo's stack (models/spec.py "gated_deltanet"
and "mamba2"), on megazoo's tensor-parallel layers: one column-parallel in-projection whose rows
are the mixer's segments, each sharded with the heads (`SegmentLayout`), the depthwise conv and
per-head parameters sharded the same way, the recurrence on this rank's heads, and a
row-parallel out-projection (a reduce-scatter along the sequence under sequence parallelism:
the in-projection gathers the sequence, so the recurrence always sees whole sequences).

The algorithms are models/gated_deltanet.py's and models/mamba2.py's (transformers' math; the
Qwen3.5 / Qwen3-Next / Nemotron-H adapters map their tensors). Under context parallelism the
recurrence runs over the context ranks' chunks in sequence order, each starting from the
state the previous chunk ended with (parallel/state_passing.py); packed documents reset it.
With a KV cache (generation) the layer's constant-size state is kept in `cache.states`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.context_split import split_sequence
from megazoo.parallel.kernels.delta_rule import gated_delta_rule
from megazoo.parallel.kernels.ssd import ssd_scan
from megazoo.parallel.mappings import copy_to_tp
from megazoo.parallel.state_passing import context_state_passing
from megazoo.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              SegmentLayout, _sharded_parameter)

from .causal_conv import causal_conv
from .gated_deltanet import LinearState


def _document_resets(documents, topo) -> torch.Tensor | None:
    """[b, s / cp] bool: this rank's tokens that start a packed document (None: no documents)."""
    if documents is None or documents.ids is None:
        return None
    ids = documents.ids
    resets = torch.ones_like(ids, dtype=torch.bool)
    resets[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return split_sequence(resets, 1, topo.cp, topo.cp_rank)


def _filled(value_fn):
    def fill(t: torch.Tensor) -> None:
        t.copy_(value_fn(t.shape))
    return fill


class _LinearMixer(nn.Module):
    """in_proj -> core (the recurrence, state in and out) -> out_proj; subclasses define `core`
    and `state_shapes`."""

    def __init__(self, topo, tp_divides: dict):
        super().__init__()
        self.topo = topo
        for what, n in tp_divides.items():
            if n % topo.tp:
                raise ValueError(f"--tensor-model-parallel-size {topo.tp} must divide the {what} "
                                 f"({n})")

    def forward(self, x, cache=None, layer: int = 0, documents=None):
        feats = self.in_proj(x)  # [s (whole under SP), b, local features]
        resets = _document_resets(documents, self.topo)
        if cache is not None:
            y, cache.states[layer] = self.core(feats, cache.states.get(layer), resets)
        elif self.topo.cp > 1:
            y = context_state_passing(self.core, self.state_shapes, feats, self.topo.cp_group,
                                      resets)
        else:
            y, _ = self.core(feats, None, resets)
        return self.out_proj(y)


class ParallelGatedDeltaNet(_LinearMixer):
    """Gated DeltaNet (Qwen3.5, Qwen3-Next): in_proj rows [q | k | v | z | b | a]; TP over key
    heads with their value heads. The gated RMSNorm's [value_head_dim] weight is shared by all
    heads: each rank normalises its own heads, so its gradient is summed over TP."""

    def __init__(self, config, topo, init, prefix, rng, spec):
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        super().__init__(topo, {"linear layers' key heads": hk, "linear layers' value heads": hv})
        tp = topo.tp
        self.hk, self.hv, self.dk, self.dv = hk // tp, hv // tp, dk, dv
        self.eps, self.chunk = config.layernorm_epsilon, config.linear_chunk_size
        kd, vd = hk * dk, hv * dv
        h, dtype = config.hidden_size, config.dtype
        self.in_proj = ColumnParallelLinear(h, 2 * kd + 2 * vd + 2 * hv, topo,
                                            init.normal(prefix + "in_proj.weight"), bias=False,
                                            dtype=dtype,
                                            layout=SegmentLayout([kd, kd, vd, vd, hv, hv]))
        channels = 2 * kd + vd
        self.conv_weight = _sharded_parameter(
            (channels, 1, config.linear_conv_kernel), 0, topo, init.normal(prefix + "conv_weight"),
            dtype, layout=SegmentLayout([kd, kd, vd]))
        self.dt_bias = _sharded_parameter((hv,), 0, topo, _filled(torch.ones), dtype)
        self.A_log = _sharded_parameter(
            (hv,), 0, topo, _filled(lambda s: torch.linspace(1, 16, s[0]).log()), dtype)
        self.norm_weight = nn.Parameter(torch.ones(dv, device=topo.device, dtype=dtype))
        self.out_proj = RowParallelLinear(vd, h, topo, init.scaled_normal(prefix + "out_proj.weight"),
                                          bias=False, dtype=dtype)

    def state_shapes(self, batch: int, dtype, device) -> list:
        channels = 2 * self.hk * self.dk + self.hv * self.dv
        return [((batch, self.conv_weight.shape[-1] - 1, channels), dtype, device),
                ((batch, self.hv, self.dk, self.dv), torch.float32, device)]

    def core(self, feats, state: LinearState | None, resets):
        kd, vd = self.hk * self.dk, self.hv * self.dv
        f = feats.transpose(0, 1)
        b, t, _ = f.shape
        qkv, z, beta, a = f.split([2 * kd + vd, vd, self.hv, self.hv], dim=-1)
        qkv, tail = causal_conv(qkv, self.conv_weight, None,
                                None if state is None else state.conv, resets)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o, recurrent = gated_delta_rule(
            q.reshape(b, t, self.hk, self.dk), k.reshape(b, t, self.hk, self.dk),
            v.reshape(b, t, self.hv, self.dv), g, beta.sigmoid(), chunk_size=self.chunk,
            initial_state=None if state is None else state.recurrent, resets=resets)
        weight = copy_to_tp(self.norm_weight, self.topo.tp_group) if self.topo.tp > 1 \
            else self.norm_weight
        dtype = o.dtype
        o32 = o.float()
        o = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        z = z.reshape(b, t, self.hv, self.dv)
        o = (weight * o * F.silu(z.float())).to(dtype)
        return o.reshape(b, t, vd).transpose(0, 1), LinearState(tail, recurrent)


class ParallelMamba2(_LinearMixer):
    """Mamba-2 (Nemotron-H): in_proj rows [z | x | B | C | dt]; TP over groups with their heads
    (the gated RMSNorm is per group, so its weight is sharded with them)."""

    def __init__(self, config, topo, init, prefix, rng, spec):
        nh, p, n, g = (config.mamba_num_heads, config.mamba_head_dim, config.mamba_state_size,
                       config.mamba_groups)
        super().__init__(topo, {"Mamba layers' heads": nh, "Mamba layers' groups": g})
        tp = topo.tp
        self.nh, self.p, self.n, self.g = nh // tp, p, n, g // tp
        self.eps, self.chunk = config.layernorm_epsilon, config.linear_chunk_size
        self.dt_min = config.mamba_time_step_min
        inner, gn = nh * p, g * n
        h, dtype = config.hidden_size, config.dtype
        self.in_proj = ColumnParallelLinear(h, 2 * inner + 2 * gn + nh, topo,
                                            init.normal(prefix + "in_proj.weight"),
                                            bias=config.mamba_proj_bias, dtype=dtype,
                                            layout=SegmentLayout([inner, inner, gn, gn, nh]))
        conv = SegmentLayout([inner, gn, gn])
        channels = inner + 2 * gn
        self.conv_weight = _sharded_parameter((channels, 1, config.linear_conv_kernel), 0, topo,
                                              init.normal(prefix + "conv_weight"), dtype,
                                              layout=conv)
        self.conv_bias = None
        if config.mamba_conv_bias:
            self.conv_bias = _sharded_parameter((channels,), 0, topo, _filled(torch.zeros), dtype,
                                                layout=conv)
        self.dt_bias = _sharded_parameter((nh,), 0, topo, _filled(torch.ones), dtype)
        self.A_log = _sharded_parameter(
            (nh,), 0, topo, _filled(lambda s: torch.arange(1, s[0] + 1).float().log()), dtype)
        self.D = _sharded_parameter((nh,), 0, topo, _filled(torch.ones), dtype)
        self.norm_weight = _sharded_parameter((inner,), 0, topo, _filled(torch.ones), dtype)
        self.out_proj = RowParallelLinear(inner, h, topo,
                                          init.scaled_normal(prefix + "out_proj.weight"),
                                          bias=config.mamba_proj_bias, dtype=dtype)

    def state_shapes(self, batch: int, dtype, device) -> list:
        channels = self.nh * self.p + 2 * self.g * self.n
        return [((batch, self.conv_weight.shape[-1] - 1, channels), dtype, device),
                ((batch, self.nh, self.p, self.n), torch.float32, device)]

    def core(self, feats, state: LinearState | None, resets):
        inner, gn = self.nh * self.p, self.g * self.n
        f = feats.transpose(0, 1)
        b, t, _ = f.shape
        z, xbc, dt = f.split([inner, inner + 2 * gn, self.nh], dim=-1)
        xbc, tail = causal_conv(xbc, self.conv_weight, self.conv_bias,
                                None if state is None else state.conv, resets)
        xs, B, C = xbc.split([inner, gn, gn], dim=-1)
        y, ssm = ssd_scan(xs.reshape(b, t, self.nh, self.p), dt, -self.A_log.float().exp(),
                          B.reshape(b, t, self.g, self.n), C.reshape(b, t, self.g, self.n),
                          self.D, self.dt_bias, limit=(self.dt_min, float("inf")),
                          chunk_size=self.chunk,
                          initial_state=None if state is None else state.recurrent, resets=resets)
        dtype = feats.dtype
        y = y.reshape(b, t, inner).float() * F.silu(z.float())
        grouped = y.reshape(b, t, self.g, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.norm_weight * grouped.reshape(b, t, inner).to(dtype)
        return y.to(dtype).transpose(0, 1), LinearState(tail, ssm)
