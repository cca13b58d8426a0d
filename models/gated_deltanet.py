"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next, with the parameter
names transformers gives it (`linear_attn.*`).

    qkv = conv(in_proj_qkv(x))   short causal depthwise conv + silu over [q | k | v] channels
    z = in_proj_z(x)             output gate, per value head
    beta = sigmoid(in_proj_b(x)), g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)   per value head
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)    (parallel/kernels/delta_rule.py)
    out_proj(rmsnorm(o) * silu(z))   the RMSNorm per value head, its weight shared by the heads

Key and value head counts differ (each key head serves v_heads / k_heads value heads).

State (`LinearState`): the conv tail [b, k - 1, channels] and the recurrent state
[b, v_heads, k_dim, v_dim] fp32; given in, the final one comes out, so generation and context
parallelism continue a sequence exactly where it was cut.

Tensor parallelism is over key heads (with their value heads): `shard_heads` cuts every
tensor of a rank's heads out of the full one (q, k, v rows and conv channels, z, a, b, A_log,
dt_bias, the out_proj columns); the RMSNorm weight is replicated; the ranks' outputs are
partial sums of out_proj (a row-parallel reduce).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.kernels.delta_rule import gated_delta_rule

from .causal_conv import causal_conv


@dataclass(frozen=True)
class GatedDeltaNetShape:
    hidden_size: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6
    chunk_size: int = 64

    def local(self, tp: int) -> "GatedDeltaNetShape":
        """This shape with 1/tp of the heads (whole key heads with their value heads)."""
        if self.key_heads % tp or self.value_heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} must divide the linear layers' "
                             f"key heads ({self.key_heads}) and value heads ({self.value_heads})")
        return GatedDeltaNetShape(self.hidden_size, self.key_heads // tp, self.value_heads // tp,
                                  self.key_head_dim, self.value_head_dim, self.conv_kernel,
                                  self.eps, self.chunk_size)

    def context_heads(self) -> dict:
        """What context parallelism by heads splits (parallel/context_heads.py): the value heads,
        in groups of their key head."""
        return {"value heads": (self.value_heads, self.key_heads)}


@dataclass
class LinearState:
    """A linear layer's constant-size state: conv tail and recurrent state."""
    conv: torch.Tensor
    recurrent: torch.Tensor


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate) over the last dim (Qwen3.5: norm before the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    State = LinearState

    def __init__(self, shape: GatedDeltaNetShape):
        super().__init__()
        self.shape = s = shape
        self.key_dim = s.key_heads * s.key_head_dim
        self.value_dim = s.value_heads * s.value_head_dim
        channels = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(s.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, s.conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.empty(s.value_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(s.value_head_dim, s.eps)
        self.out_proj = nn.Linear(self.value_dim, s.hidden_size, bias=False)

    def state_shapes(self, batch: int, dtype: torch.dtype, device) -> list:
        """(shape, dtype, device) of the conv tail and the recurrent state."""
        s = self.shape
        return [((batch, s.conv_kernel - 1, 2 * self.key_dim + self.value_dim), dtype, device),
                ((batch, s.value_heads, s.key_head_dim, s.value_head_dim), torch.float32, device)]

    def forward(self, x: torch.Tensor, state: LinearState | None = None,
                resets: torch.Tensor | None = None) -> tuple[torch.Tensor, LinearState]:
        """x [s, b, hidden] -> (out [s, b, hidden], the state after the last token). `resets`
        [b, s] bool: True where a packed document starts (conv and state start afresh)."""
        s = self.shape
        x = x.transpose(0, 1)
        b, t, _ = x.shape
        qkv, tail = causal_conv(self.in_proj_qkv(x), self.conv1d.weight, None,
                                None if state is None else state.conv, resets)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, s.key_heads, s.key_head_dim)
        k = k.reshape(b, t, s.key_heads, s.key_head_dim)
        v = v.reshape(b, t, s.value_heads, s.value_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        o, recurrent = gated_delta_rule(q, k, v, g, beta, chunk_size=s.chunk_size,
                                        initial_state=None if state is None else state.recurrent,
                                        resets=resets)
        z = self.in_proj_z(x).reshape(b, t, s.value_heads, s.value_head_dim)
        o = self.norm(o, z).reshape(b, t, self.value_dim)
        return self.out_proj(o).transpose(0, 1), LinearState(tail, recurrent)


def shard_heads(name: str, full: torch.Tensor, shape: GatedDeltaNetShape, rank: int, tp: int
                ) -> torch.Tensor:
    """This TP rank's part of the full tensor `name` (a GatedDeltaNet parameter name)."""
    if tp == 1 or name == "norm.weight":
        return full
    kd, vd = shape.key_heads * shape.key_head_dim, shape.value_heads * shape.value_head_dim

    def part(t, size):
        return t.chunk(tp, dim=0)[rank] if size else t

    if name in ("in_proj_qkv.weight", "conv1d.weight"):
        q, k, v = full.split([kd, kd, vd], dim=0)
        return torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
    if name in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        return part(full, True)
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    raise KeyError(f"GatedDeltaNet has no parameter {name}")
