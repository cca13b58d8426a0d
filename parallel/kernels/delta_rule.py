"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3.5 / Qwen3-Next's linear layers),
chunked, with the recurrent state in and out, the kernel picked by device (`choose_delta_rule`).

Per value head the state S is [dk, dv]. Token t, with decay g_t <= 0 (log space) and beta_t:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

Chunked (C tokens, G_t = cumulative g inside the chunk, S0 the state at the chunk's start): the
corrections u solve the unit lower-triangular system

    (I + A) U = beta V - diag(beta exp(G)) K S0,   A[t, j] = beta_t exp(G_t - G_j) k_t.k_j  (j < t)

so U = W - Y S0 with W, Y from one triangular solve per chunk (done for every chunk at once);
then o_t = exp(G_t) q_t^T S0 + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) u_j and the chunk's end state
exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T. Only the last two steps run chunk after chunk.

  CUDA with flash-linear-attention (`fla`) installed   its chunk_gated_delta_rule (Triton)
  elsewhere                                            `chunk_delta_rule` below, in fp32 (logged once)
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .choice_log import log_choice_once


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def choose_delta_rule(device: torch.device, fla_installed: bool | None = None) -> str:
    """"fla" on CUDA when flash-linear-attention is installed, else "torch"."""
    device = torch.device(device)
    installed = fla_available() if fla_installed is None else fla_installed
    return "fla" if device.type == "cuda" and installed else "torch"


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's and transformers' rule)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, chunk_size: int = 64, resets=None):
    """q, k [b, t, hk, dk], v [b, t, hv, dv], g and beta [b, t, hv] -> (o [b, t, hv, dv] in v's dtype,
    final state [b, hv, dk, dv] fp32). q and k are L2-normalised here; q is scaled by dk^-1/2.
    Each key head serves hv / hk consecutive value heads. `resets` [b, t] bool: True where a
    packed document starts (the state is discarded before that token)."""
    kernel = choose_delta_rule(q.device)
    if kernel == "fla" and resets is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        rep = v.shape[2] // k.shape[2]
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        o, state = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, state.float()
    if q.device.type == "cuda":
        log_choice_once(__name__, "gated delta rule on CUDA without flash-linear-attention (fla) "
                        "or with packed documents: the chunked PyTorch version runs")
    return chunk_delta_rule(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size,
                            resets=resets)


def _heads_first(x: torch.Tensor, rep: int = 1) -> torch.Tensor:
    if rep > 1:
        x = x.repeat_interleave(rep, dim=2)
    return x.transpose(1, 2).float()


def chunk_delta_rule(q, k, v, g, beta, *, initial_state=None, chunk_size: int = 64, resets=None):
    """The chunked gated delta rule in PyTorch, fp32 (module docstring); same contract as
    `gated_delta_rule`. With `resets`, pairs of tokens in different documents are masked out,
    the start state is read only before a chunk's first reset, and only the last document of a
    chunk writes its end state (`document_masks`)."""
    b, t, hk, dk = k.shape
    hv, dv, dtype = v.shape[2], v.shape[3], v.dtype
    rep = hv // hk
    q = l2_normalize(_heads_first(q, rep)) * dk ** -0.5
    k = l2_normalize(_heads_first(k, rep))
    v, g, beta = _heads_first(v), g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    pad = (-t) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, hv, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(b, hv, n, chunk_size), beta.reshape(b, hv, n, chunk_size)
    G = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_j) for j <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    decay, fresh, last = document_masks(resets, t + pad, n, chunk_size, decay)
    kb = k * beta.unsqueeze(-1)
    strict = (kb @ k.transpose(-1, -2)) * decay
    system = strict.masked_fill(~causal.tril(-1), 0) + torch.eye(chunk_size, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * (G.exp() * fresh).unsqueeze(-1)], dim=-1)
    W, Y = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    scores = (q @ k.transpose(-1, -2)) * decay          # [b, h, n, C, C], lower triangular
    q_in = q * (G.exp() * fresh).unsqueeze(-1)                # reads of the chunk's start state
    k_out = k * ((G[..., -1:] - G).exp() * last).unsqueeze(-1)  # writes into its end state
    chunk_decay = (G[..., -1].exp() * fresh[..., -1])[..., None, None]
    state = (torch.zeros(b, hv, dk, dv, device=q.device) if initial_state is None
             else initial_state.float())
    outs = []
    # chunks taken with unbind: indexing chunk i would make backward build a zero gradient of
    # the whole tensor per chunk (time quadratic in the number of chunks); unbind's is one stack
    for w, y, q_i, s_i, d_i, k_i in zip(*(x.unbind(2) for x in (W, Y, q_in, scores,
                                                                chunk_decay, k_out))):
        u = w - y @ state
        outs.append(q_i @ state + s_i @ u)
        state = state * d_i + k_i.transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(b, hv, n * chunk_size, dv)[:, :, :t]
    return o.transpose(1, 2).to(dtype), state


def document_masks(resets, padded: int, n: int, chunk_size: int, decay: torch.Tensor):
    """For packed documents (`resets` [b, t], True at a document's first token; None: one
    document): `decay` [b, h, n, C, C] times "same document", `fresh` (the token's document
    began before the chunk: it reads the start state) and `last` (the token is in the chunk's
    last document: it writes the end state), each [b or 1, 1, n, C]."""
    if resets is None:
        ones = decay.new_ones(1, 1, n, chunk_size)
        return decay, ones, ones
    r = F.pad(resets.to(decay.dtype), (0, padded - resets.shape[1]))
    r = r.reshape(resets.shape[0], 1, n, chunk_size)
    seg = r.cumsum(-1)
    same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).to(decay.dtype)
    return decay * same, (seg == 0).to(decay.dtype), (seg == seg[..., -1:]).to(decay.dtype)


def recurrent_delta_rule(q, k, v, g, beta, *, initial_state=None):
    """Token by token (generation, and the reference of the chunked form); same contract."""
    b, t, hk, dk = k.shape
    hv, dv, dtype = v.shape[2], v.shape[3], v.dtype
    rep = hv // hk
    q = l2_normalize(_heads_first(q, rep)) * dk ** -0.5
    k = l2_normalize(_heads_first(k, rep))
    v, g, beta = _heads_first(v), g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    state = torch.zeros(b, hv, dk, dv, device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        u = beta[:, :, i, None] * (v[:, :, i] - (state * k[:, :, i, :, None]).sum(-2))
        state = state + k[:, :, i, :, None] * u[:, :, None, :]
        outs.append((state * q[:, :, i, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(dtype), state
