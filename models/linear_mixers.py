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
When the heads split over the context ranks (parallel/context_heads.py: heads, and key heads or
Mamba groups, divisible by tp x cp, or groups repeated), the layer runs by heads instead: an
all-to-all gives each context rank the whole sequence for a cp-th of the heads, the scan runs
there with no state passed, and a second all-to-all brings the output back; the output gate and
norm then run on the rank's own tokens (the gate's features never travel). Which of the two a
layer kind takes, and why, is logged once.
With a KV cache (generation) the layer's constant-size state is kept in `cache.states`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.context_heads import Segment, context_heads, head_split_problem
from megazoo.parallel.context_split import split_sequence
from megazoo.parallel.kernels.choice_log import log_choice_once
from megazoo.parallel.kernels.delta_rule import gated_delta_rule
from megazoo.parallel.kernels.ssd import ssd_scan
from megazoo.parallel.mappings import copy_to_tp
from megazoo.parallel.state_passing import context_state_passing
from megazoo.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              SegmentLayout, _sharded_parameter)

from .causal_conv import causal_conv
from .gated_deltanet import LinearState


def _document_resets(documents, topo, whole: bool = False) -> torch.Tensor | None:
    """[b, s / cp] bool: this rank's tokens that start a packed document (None: no documents);
    `whole`: [b, s], the whole sequence's (the ids are whole on every context rank)."""
    if documents is None or documents.ids is None:
        return None
    ids = documents.ids
    resets = torch.ones_like(ids, dtype=torch.bool)
    resets[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return resets if whole else split_sequence(resets, 1, topo.cp, topo.cp_rank)


def _filled(value_fn):
    def fill(t: torch.Tensor) -> None:
        t.copy_(value_fn(t.shape))
    return fill


class _LinearMixer(nn.Module):
    """in_proj -> scan (the conv and the recurrence, state in and out) -> gate (the gated norm,
    per token) -> out_proj. Subclasses define `scan(feats, state, resets, part=None)`,
    `gate_input(feats)`, `gate(y, z)`, `state_shapes` and `segments` (the in_proj features'
    layout for the all-to-all; `part` a `HeadPart`: feats then hold that part's heads only)."""

    def __init__(self, topo, kind: str, tp_divides: dict, cp_heads: dict):
        super().__init__()
        self.topo = topo
        for what, n in tp_divides.items():
            if n % topo.tp:
                raise ValueError(f"--tensor-model-parallel-size {topo.tp} must divide the {what} "
                                 f"({n})")
        self.by_heads = False
        if topo.cp > 1:
            problem = head_split_problem(cp_heads, topo.tp, topo.cp)
            self.by_heads = problem is None
            log_choice_once(__name__, f"{kind} layers at --context-parallel-size {topo.cp}: " + (
                "by heads (all-to-all; every context rank runs the whole sequence for its share "
                "of the heads, all ranks at once)" if problem is None else
                f"the state-passing chain (the context ranks one after another), because {problem}"))

    def forward(self, x, cache=None, layer: int = 0, documents=None):
        feats = self.in_proj(x)  # [s (whole under SP), b, local features]
        z = self.gate_input(feats)
        if cache is not None:
            y, cache.states[layer] = self.scan(feats, cache.states.get(layer),
                                               _document_resets(documents, self.topo))
        elif self.by_heads:
            y = context_heads(self.scan, feats, self.segments, self.topo.cp_group,
                              _document_resets(documents, self.topo, whole=True))
        elif self.topo.cp > 1:
            y = context_state_passing(self.scan, self.state_shapes, feats, self.topo.cp_group,
                                      _document_resets(documents, self.topo))
        else:
            y, _ = self.scan(feats, None, _document_resets(documents, self.topo))
        return self.out_proj(self.gate(y, z))


class ParallelGatedDeltaNet(_LinearMixer):
    """Gated DeltaNet (Qwen3.5, Qwen3-Next): in_proj rows [q | k | v | z | b | a]; TP over key
    heads with their value heads. The gated RMSNorm's [value_head_dim] weight is shared by all
    heads: each rank normalises its own heads, so its gradient is summed over TP."""

    def __init__(self, config, topo, init, prefix, rng, spec):
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        super().__init__(topo, "Gated DeltaNet",
                         {"linear layers' key heads": hk, "linear layers' value heads": hv},
                         {"value heads": (hv, hk)})
        tp = topo.tp
        self.hk, self.hv, self.dk, self.dv = hk // tp, hv // tp, dk, dv
        self.eps, self.chunk = config.layernorm_epsilon, config.linear_chunk_size
        kd, vd = hk * dk, hv * dv
        h, dtype = config.hidden_size, config.dtype
        self.in_proj = ColumnParallelLinear(h, 2 * kd + 2 * vd + 2 * hv, topo,
                                            init.normal(prefix + "in_proj.weight"), bias=False,
                                            dtype=dtype,
                                            layout=SegmentLayout([kd, kd, vd, vd, hv, hv]))
        # this TP rank's features: q, k (key heads), v (value heads), z (stays), b, a
        lk, lv = self.hk * dk, self.hv * dv
        self.segments = [Segment(lk, self.hk), Segment(lk, self.hk), Segment(lv, self.hv),
                         Segment(lv, 0), Segment(self.hv, self.hv), Segment(self.hv, self.hv)]
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

    def gate_input(self, feats):
        start = 2 * self.hk * self.dk + self.hv * self.dv
        return feats[..., start:start + self.hv * self.dv]

    def scan(self, feats, state: LinearState | None, resets, part=None):
        seg, conv_weight, dt_bias, A_log = self.segments, self.conv_weight, self.dt_bias, self.A_log
        if part is not None:  # feats: [q | k | v | b | a] of the part's heads
            conv_weight = part.take(conv_weight, seg[:3])
            dt_bias, A_log = part.take(dt_bias, seg[4:5]), part.take(A_log, seg[4:5])
            seg = [Segment(part.width(s), 0) for s in seg]
            seg[3] = Segment(0, 0)
        kd, vd, hv = seg[0].width, seg[2].width, seg[4].width
        hk = kd // self.dk
        f = feats.transpose(0, 1)
        b, t, _ = f.shape
        qkv, _, beta, a = f.split([2 * kd + vd, seg[3].width, hv, hv], dim=-1)
        qkv, tail = causal_conv(qkv, conv_weight, None,
                                None if state is None else state.conv, resets)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        o, recurrent = gated_delta_rule(
            q.reshape(b, t, hk, self.dk), k.reshape(b, t, hk, self.dk),
            v.reshape(b, t, hv, self.dv), g, beta.sigmoid(), chunk_size=self.chunk,
            initial_state=None if state is None else state.recurrent, resets=resets)
        return o.reshape(b, t, vd).transpose(0, 1), LinearState(tail, recurrent)

    def gate(self, o, z):
        """rmsnorm(o) per value head x weight x silu(z), o and z [t, b, value heads x dv]."""
        weight = copy_to_tp(self.norm_weight, self.topo.tp_group) if self.topo.tp > 1 \
            else self.norm_weight
        t, b, vd = o.shape
        dtype = o.dtype
        o32 = o.float().reshape(t, b, self.hv, self.dv)
        o = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        z = z.reshape(t, b, self.hv, self.dv)
        return (weight * o * F.silu(z.float())).to(dtype).reshape(t, b, vd)


class ParallelMamba2(_LinearMixer):
    """Mamba-2 (Nemotron-H): in_proj rows [z | x | B | C | dt]; TP over groups with their heads
    (the gated RMSNorm is per group, so its weight is sharded with them)."""

    def __init__(self, config, topo, init, prefix, rng, spec):
        nh, p, n, g = (config.mamba_num_heads, config.mamba_head_dim, config.mamba_state_size,
                       config.mamba_groups)
        super().__init__(topo, "Mamba-2", {"Mamba layers' heads": nh, "Mamba layers' groups": g},
                         {"Mamba heads": (nh, g)})
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
        # this TP rank's features: z (stays), x (heads), B, C (groups), dt (heads)
        li, lg = self.nh * p, self.g * n
        self.segments = [Segment(li, 0), Segment(li, self.nh), Segment(lg, self.g),
                         Segment(lg, self.g), Segment(self.nh, self.nh)]
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

    def gate_input(self, feats):
        return feats[..., :self.nh * self.p]

    def scan(self, feats, state: LinearState | None, resets, part=None):
        seg = self.segments
        conv_weight, conv_bias, dt_bias, A_log, D = (self.conv_weight, self.conv_bias,
                                                     self.dt_bias, self.A_log, self.D)
        if part is not None:  # feats: [x | B | C | dt] of the part's heads and groups
            conv_weight = part.take(conv_weight, seg[1:4])
            conv_bias = None if conv_bias is None else part.take(conv_bias, seg[1:4])
            dt_bias, A_log, D = (part.take(w, seg[4:]) for w in (dt_bias, A_log, D))
            seg = [Segment(0, 0)] + [Segment(part.width(s), 0) for s in seg[1:]]
        inner, gn, nh = seg[1].width, seg[2].width, seg[4].width
        f = feats.transpose(0, 1)
        b, t, _ = f.shape
        _, xbc, dt = f.split([seg[0].width, inner + 2 * gn, nh], dim=-1)
        xbc, tail = causal_conv(xbc, conv_weight, conv_bias,
                                None if state is None else state.conv, resets)
        xs, B, C = xbc.split([inner, gn, gn], dim=-1)
        g = gn // self.n
        y, ssm = ssd_scan(xs.reshape(b, t, nh, self.p), dt, -A_log.float().exp(),
                          B.reshape(b, t, g, self.n), C.reshape(b, t, g, self.n),
                          D, dt_bias, limit=(self.dt_min, float("inf")),
                          chunk_size=self.chunk,
                          initial_state=None if state is None else state.recurrent, resets=resets)
        return y.reshape(b, t, inner).transpose(0, 1), LinearState(tail, ssm)

    def gate(self, y, z):
        """weight x rmsnorm per group of (y x silu(z)), y (fp32) and z [t, b, heads x head_dim]."""
        t, b, inner = y.shape
        dtype = z.dtype
        y = y.float() * F.silu(z.float())
        grouped = y.reshape(t, b, self.g, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * grouped.reshape(t, b, inner).to(dtype)).to(dtype)
