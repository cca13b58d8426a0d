"""Mamba-2, the state-space token mixer of Nemotron-H, with the parameter names transformers gives
it (`mixer.*`).

    [z | xBC | dt] = in_proj(x)       gate (heads x head_dim), conv channels, one dt per head
    xBC = conv(xBC)                   short causal depthwise conv (+ bias) + silu
    y = ssd(x, dt, A = -exp(A_log), B, C, D, dt_bias)   B, C shared by the heads of a group,
                                      dt = clamp(softplus(dt + dt_bias), time_step_min, inf)
    out_proj(grouped_rmsnorm(y * silu(z)))   the RMSNorm over each group's channels

State (`LinearState`): the conv tail [b, k - 1, channels] and the SSM state [b, heads, head_dim,
state] fp32, in and out as in Gated DeltaNet (generation, context parallelism).

Tensor parallelism is over groups with their heads (`shard_heads`): z and x rows, B and C rows
of the rank's groups, their conv channels, dt rows, A_log, D, dt_bias, the norm weight (its
groups), the out_proj columns; the ranks' outputs are partial sums of out_proj.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.kernels.ssd import ssd_scan

from .causal_conv import causal_conv
from .gated_deltanet import LinearState


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int = 4
    eps: float = 1e-5
    chunk_size: int = 128
    time_step_min: float = 0.0
    conv_bias: bool = True
    bias: bool = False

    def local(self, tp: int) -> "Mamba2Shape":
        if self.groups % tp or self.heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} must divide the Mamba layers' "
                             f"groups ({self.groups}) and heads ({self.heads})")
        return Mamba2Shape(self.hidden_size, self.heads // tp, self.head_dim, self.state_size,
                           self.groups // tp, self.conv_kernel, self.eps, self.chunk_size,
                           self.time_step_min, self.conv_bias, self.bias)

    def context_heads(self) -> dict:
        """What context parallelism by heads splits (parallel/context_heads.py): the heads, in
        their groups."""
        return {"Mamba heads": (self.heads, self.groups)}


class GroupedGatedRMSNorm(nn.Module):
    """weight * rmsnorm(x * silu(gate)) with the mean over each group's channels (Nemotron-H:
    gate before the norm)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        grouped = x.reshape(*x.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.reshape(x.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    State = LinearState

    def __init__(self, shape: Mamba2Shape):
        super().__init__()
        self.shape = s = shape
        self.inner = s.heads * s.head_dim
        self.channels = self.inner + 2 * s.groups * s.state_size
        self.in_proj = nn.Linear(s.hidden_size, self.inner + self.channels + s.heads, bias=s.bias)
        self.conv1d = nn.Conv1d(self.channels, self.channels, s.conv_kernel, groups=self.channels,
                                bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.heads))
        self.A_log = nn.Parameter(torch.arange(1, s.heads + 1, dtype=torch.float32).log())
        self.D = nn.Parameter(torch.ones(s.heads))
        self.norm = GroupedGatedRMSNorm(self.inner, s.groups, s.eps)
        self.out_proj = nn.Linear(self.inner, s.hidden_size, bias=s.bias)

    def state_shapes(self, batch: int, dtype: torch.dtype, device) -> list:
        """(shape, dtype, device) of the conv tail and the SSM state."""
        s = self.shape
        return [((batch, s.conv_kernel - 1, self.channels), dtype, device),
                ((batch, s.heads, s.head_dim, s.state_size), torch.float32, device)]

    def forward(self, x: torch.Tensor, state: LinearState | None = None,
                resets: torch.Tensor | None = None) -> tuple[torch.Tensor, LinearState]:
        """x [s, b, hidden] -> (out [s, b, hidden], the state after the last token). `resets`
        [b, s] bool: True where a packed document starts (conv and state start afresh)."""
        s = self.shape
        x = x.transpose(0, 1)
        b, t, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([self.inner, self.channels, s.heads], dim=-1)
        xbc, tail = causal_conv(xbc, self.conv1d.weight, self.conv1d.bias,
                                None if state is None else state.conv, resets)
        xs, B, C = xbc.split([self.inner, s.groups * s.state_size, s.groups * s.state_size], -1)
        y, ssm = ssd_scan(xs.reshape(b, t, s.heads, s.head_dim), dt, -self.A_log.float().exp(),
                          B.reshape(b, t, s.groups, s.state_size),
                          C.reshape(b, t, s.groups, s.state_size), self.D, self.dt_bias,
                          limit=(s.time_step_min, float("inf")), chunk_size=s.chunk_size,
                          initial_state=None if state is None else state.recurrent,
                          resets=resets)
        y = self.norm(y.reshape(b, t, self.inner), z)
        return self.out_proj(y.to(x.dtype)).transpose(0, 1), LinearState(tail, ssm)


def shard_heads(name: str, full: torch.Tensor, shape: Mamba2Shape, rank: int, tp: int
                ) -> torch.Tensor:
    """This TP rank's part of the full tensor `name` (a Mamba2Mixer parameter name)."""
    if tp == 1:
        return full
    inner, gn = shape.heads * shape.head_dim, shape.groups * shape.state_size
    if name in ("in_proj.weight", "in_proj.bias"):
        parts = full.split([inner, inner, gn, gn, shape.heads], dim=0)
        return torch.cat([p.chunk(tp)[rank] for p in parts])
    if name in ("conv1d.weight", "conv1d.bias"):
        parts = full.split([inner, gn, gn], dim=0)
        return torch.cat([p.chunk(tp)[rank] for p in parts])
    if name in ("dt_bias", "A_log", "D", "norm.weight"):
        return full.chunk(tp)[rank]
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    if name in ("out_proj.bias",):
        raise ValueError("Mamba-2 with use_bias under tensor parallelism: out_proj's bias belongs "
                         "after the reduction of the ranks' partial sums; run it at tp 1")
    raise KeyError(f"Mamba2Mixer has no parameter {name}")
