"""Mamba-2's state space duality scan (SSD, Dao & Gu 2024; Nemotron-H's Mamba layers), chunked,
with the recurrent state in and out, the kernel picked by device (`choose_ssd`).

Per head (A < 0 a scalar, dt_t = clamp(softplus(dt_raw_t + dt_bias), limits)) the state h is
[head_dim, state]; B_t, C_t [state] are shared by the heads of a group:

    h <- exp(dt_t A) h + dt_t x_t B_t^T;   y_t = h C_t + D x_t

Chunked (C tokens, G_t = cumulative dt A inside the chunk, h0 the chunk's start state):
y_t = exp(G_t) h0 C_t + sum_{j<=t} exp(G_t - G_j) (C_t.B_j) dt_j x_j + D x_t, and the end state
exp(G_C) h0 + sum_j exp(G_C - G_j) dt_j x_j B_j^T: quadratic inside a chunk (every chunk at
once), one small step per chunk between them.

  CUDA with mamba_ssm installed   its mamba_chunk_scan_combined (Triton)
  elsewhere                       `chunk_ssd` below, in fp32 (logged once)
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .choice_log import log_choice_once
from .delta_rule import document_masks


def mamba_ssm_available() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


def choose_ssd(device: torch.device, mamba_ssm_installed: bool | None = None) -> str:
    """"mamba_ssm" on CUDA when mamba_ssm is installed, else "torch"."""
    device = torch.device(device)
    installed = mamba_ssm_available() if mamba_ssm_installed is None else mamba_ssm_installed
    return "mamba_ssm" if device.type == "cuda" and installed else "torch"


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), *limit) in fp32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(limit[0], limit[1])


def ssd_scan(x, dt, A, B, C, D, dt_bias, *, limit=(0.0, float("inf")), initial_state=None,
             chunk_size: int = 128, resets=None):
    """x [b, t, h, p], dt [b, t, h] (before bias and softplus), A, D, dt_bias [h], B, C [b, t, g, n]
    -> (y [b, t, h, p] fp32, final state [b, h, p, n] fp32). `resets` [b, t] bool: True where a
    packed document starts."""
    if choose_ssd(x.device) == "mamba_ssm" and resets is None:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        y, state = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                             initial_states=initial_state, dt_softplus=True,
                                             dt_limit=limit, return_final_states=True)
        return y.float(), state.float()
    if x.device.type == "cuda":
        log_choice_once(__name__, "Mamba-2 scan on CUDA without mamba_ssm or with packed "
                        "documents: the chunked PyTorch version runs")
    return chunk_ssd(x, dt, A, B, C, D, dt_bias, limit=limit, initial_state=initial_state,
                     chunk_size=chunk_size, resets=resets)


def chunk_ssd(x, dt, A, B, C, D, dt_bias, *, limit=(0.0, float("inf")), initial_state=None,
              chunk_size: int = 128, resets=None):
    """The chunked scan in PyTorch, fp32 (module docstring); same contract as `ssd_scan`."""
    b, t, h, p = x.shape
    rep = h // B.shape[2]
    dt = discretize(dt, dt_bias, limit).transpose(1, 2)                  # [b, h, t]
    xs = x.float().transpose(1, 2)                                       # [b, h, t, p]
    Bh = B.float().repeat_interleave(rep, dim=2).transpose(1, 2)         # [b, h, t, n]
    Ch = C.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    skip = xs * D.float()[:, None, None]
    pad = (-t) % chunk_size
    if pad:
        xs, Bh, Ch = (F.pad(z, (0, 0, 0, pad)) for z in (xs, Bh, Ch))
        dt = F.pad(dt, (0, pad))
    n = (t + pad) // chunk_size
    xs, Bh, Ch = (z.reshape(b, h, n, chunk_size, -1) for z in (xs, Bh, Ch))
    dt = dt.reshape(b, h, n, chunk_size)
    G = (dt * A.float()[:, None, None]).cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    decay, fresh, last = document_masks(resets, t + pad, n, chunk_size, decay)
    u = xs * dt.unsqueeze(-1)
    intra = ((Ch @ Bh.transpose(-1, -2)) * decay) @ u                    # [b, h, n, C, p]
    c_in = Ch * (G.exp() * fresh).unsqueeze(-1)
    b_out = Bh * ((G[..., -1:] - G).exp() * last).unsqueeze(-1)
    chunk_decay = (G[..., -1].exp() * fresh[..., -1])[..., None, None]
    state = (torch.zeros(b, h, p, Bh.shape[-1], device=x.device) if initial_state is None
             else initial_state.float())
    outs = []
    # chunks taken with unbind, not indexed: see delta_rule.py (backward linear in the chunks)
    for in_i, c_i, d_i, u_i, b_i in zip(*(x.unbind(2) for x in (intra, c_in, chunk_decay, u,
                                                                 b_out))):
        outs.append(in_i + c_i @ state.transpose(-1, -2))
        state = state * d_i + u_i.transpose(-1, -2) @ b_i
    y = torch.stack(outs, dim=2).reshape(b, h, n * chunk_size, p)[:, :, :t] + skip
    return y.transpose(1, 2), state
