"""One block of ring attention with its log-sum-exp, on the device's fused kernel
(`parallel/ring_attention.py` merges the blocks and falls back to plain matmuls).

A ring step needs a kernel that returns the block's log-sum-exp and whose backward takes the
*final* output and log-sum-exp of the query rows (so no block materialises its scores):

  cpu_flash   the CPU: aten's flash kernel for the CPU, in fp32 (the ring's measured CPU path:
              K/V travel and blocks run in fp32), with an additive mask for ALiBi
  cuda_flash  CUDA bf16/fp16 without a bias, Ampere or later: FlashAttention-2 through aten's
              variable-length entry points (every sample one sequence), in the activation dtype
  matmul      everything else (fp32 on CUDA, ALiBi on CUDA): the ring's own fp32 matmuls
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLASH_MIN_CAPABILITY = (8, 0)


def choose_block_kernel(device: torch.device, dtype: torch.dtype, *, bias: bool,
                        capability: tuple[int, int] | None = None) -> str:
    """"cpu_flash" | "cuda_flash" | "matmul" for a block of `dtype` on `device` (`bias`: an
    additive ALiBi bias; `capability`: a CUDA device's, read from the device when None)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and dtype in LOW_PRECISION and not bias:
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if tuple(capability) >= FLASH_MIN_CAPABILITY:
            return "cuda_flash"
    return "matmul"


def ring_compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V travel around the ring in and blocks are computed in: fp32 on the CPU (its
    flash kernel's fp32 path, measured), the activation dtype elsewhere (half the bytes on the
    wire in bf16; partial outputs, log-sum-exps and dK/dV accumulators stay fp32)."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads [b, g, n, d] -> one per query head (grouped order)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-query-head gradients [b, heads, n, d] -> per key/value head [b, groups, n, d]."""
    b, heads, n, d = t.shape
    return t if heads == groups else t.reshape(b, groups, heads // groups, n, d).sum(2)


def fused_block_forward(kernel: str, q, k, v, scale: float, mask, causal: bool):
    """(out, lse [b, heads, m] fp32) of q [b, heads, m, d] over k [b, kv_heads, n, d], v
    [b, kv_heads, n, dv] (dv may differ from d: out has v's);
    `mask`: an additive [1, heads or 1, m, n] bias already holding any causal -inf (then
    `causal` is ignored), or None."""
    heads, v_dim = q.shape[1], v.shape[3]
    q, k, v = _one_head_dim(q, expand_heads(k, heads), expand_heads(v, heads))
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=mask, scale=scale)
        return out[..., :v_dim], lse
    varlen = _Varlen(q, k)
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        varlen.flat(q), varlen.flat(k), varlen.flat(v), varlen.cu_q, varlen.cu_k, varlen.m,
        varlen.n, 0.0, causal, False, scale=scale)
    return varlen.unflat(out)[..., :v_dim], varlen.lse_to_batched(lse)


def fused_block_backward(kernel: str, q, k, v, do, out, lse, scale: float, mask, causal: bool):
    """(dq, dk, dv) of one block given the final output and lse of its query rows; dk, dv per
    key/value head."""
    heads, groups, qk_dim, v_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    q, k, v, do, out = _one_head_dim(q, expand_heads(k, heads), expand_heads(v, heads), do, out)
    if kernel == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal and mask is None, attn_mask=mask, scale=scale)
    else:
        varlen = _Varlen(q, k)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            varlen.flat(do), varlen.flat(q), varlen.flat(k), varlen.flat(v), varlen.flat(out),
            varlen.lse_to_flat(lse), varlen.cu_q, varlen.cu_k, varlen.m, varlen.n, 0.0, causal,
            rng_state, unused, scale=scale)
        dq, dk, dv = varlen.unflat(dq), varlen.unflat(dk, varlen.n), varlen.unflat(dv, varlen.n)
    return (dq[..., :qk_dim], sum_groups(dk[..., :qk_dim], groups),
            sum_groups(dv[..., :v_dim], groups))


def _one_head_dim(q, k, v, *outputs):
    """q, k, v (and output-shaped tensors) zero-padded to one head dim: the fused kernels take
    a single one, multi-latent attention's v has its own. Zero channels leave q k^T, p v and
    the backward's rowsum(dO * O) unchanged; the callers cut the padding from the results."""
    dim = max(q.shape[3], v.shape[3])
    if q.shape[3] == v.shape[3]:
        return (q, k, v, *outputs)
    return tuple(t if t.shape[3] == dim else F.pad(t, (0, dim - t.shape[3]))
                 for t in (q, k, v, *outputs))


@functools.lru_cache(maxsize=None)
def _flash_lse_layout(device: torch.device) -> str:
    """How this torch's variable-length FlashAttention lays out its log-sum-exp, probed once per
    device with two one-token sequences of one head: "heads_tokens" [heads, tokens] (FA >= 2.4),
    "tokens_heads" [tokens, heads], or "batched" [sequences, heads, longest]."""
    t = torch.zeros(2, 1, 8, dtype=torch.bfloat16, device=device)
    cu = torch.arange(3, dtype=torch.int32, device=device)
    lse = torch.ops.aten._flash_attention_forward(t, t, t, cu, cu, 1, 1, 0.0, False, False)[1]
    return {(1, 2): "heads_tokens", (2, 1): "tokens_heads"}.get(tuple(lse.shape), "batched")


class _Varlen:
    """[b, heads, s, d] <-> FlashAttention's variable-length layout [b * s, heads, d], every
    sample one sequence, and its log-sum-exp <-> the ring's [b, heads, m] fp32."""

    def __init__(self, q, k):
        self.b, self.heads, self.m, self.n = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        self.cu_q, self.cu_k = (torch.arange(0, (self.b + 1) * s, s, dtype=torch.int32,
                                             device=q.device) for s in (self.m, self.n))
        self.layout = _flash_lse_layout(q.device)

    def flat(self, t):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()

    def unflat(self, t, s=None):
        return t.view(self.b, s or self.m, t.shape[1], t.shape[2]).transpose(1, 2)

    def lse_to_batched(self, lse):
        if self.layout == "heads_tokens":
            return lse.view(self.heads, self.b, self.m).transpose(0, 1).contiguous()
        if self.layout == "tokens_heads":
            return lse.view(self.b, self.m, self.heads).transpose(1, 2).contiguous()
        return lse[..., :self.m].contiguous()

    def lse_to_flat(self, lse):
        if self.layout == "heads_tokens":
            return lse.transpose(0, 1).reshape(self.heads, self.b * self.m).contiguous()
        if self.layout == "tokens_heads":
            return lse.transpose(1, 2).reshape(self.b * self.m, self.heads).contiguous()
        return lse.contiguous()
