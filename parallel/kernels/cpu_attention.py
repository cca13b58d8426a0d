"""SDPA's fused CPU kernel for bf16/fp16 attention, each pass in its faster precision (the
measured crossovers are in `CpuLowPrecisionAttention`'s docstring). `parallel/kernels/attention.py`
decides when it runs."""
from __future__ import annotations

import torch


def available() -> bool:
    """torch has the CPU flash kernel this Function calls (torch >= 2.3)."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


# Keys up to which the bf16 backward runs in fp32 on the CPU (see CpuLowPrecisionAttention).
CPU_BF16_FP32_BACKWARD_MAX_KEYS = 512


def native_bf16(dtype: torch.dtype) -> bool:
    """bf16 runs in its own kernel here: ATen runs its AVX-512 kernels (see below)."""
    return dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "AVX512"


class CpuLowPrecisionAttention(torch.autograd.Function):
    """SDPA's fused CPU kernel for bf16/fp16 inputs, each pass in the faster precision (torch
    2.13, one core, causal forward / backward in ms, Xeon with AMX; the fp32 figures include
    the casts):

        [b, heads, seq, d]    bf16 fwd  fp32 fwd   bf16 bwd  fp32 bwd
        [4, 8, 256, 32]          2.7       4.3       17.7      10.8
        [4, 8, 256, 64]          2.8       6.5       22.0      19.1
        [2, 8, 1024, 64]        18.4      36.3       75.4     104.9
        [1, 16, 2048, 128]      80.9     235.4      395.3     630.0

    So bf16 runs forward in bf16 and backward in fp32 up to `CPU_BF16_FP32_BACKWARD_MAX_KEYS`
    keys, in bf16 beyond; fp16's own kernel is slower than fp32 at every size above (1.1-1.9x),
    so fp16 runs both passes in fp32. bf16 stays in fp32 too where ATen does not run its AVX-512
    kernels (`ATEN_CPU_CAPABILITY=avx2` on an AMX machine fails in the bf16 kernel: "pack_vnni2
    is only supported when avx512 is supported"; other CPUs were not measured). Either way
    autograd saves what the low-precision kernel saves (q, k, v and the output in their dtype,
    the fp32 logsumexp): activation memory is unchanged. GPUs keep their own kernels."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal=True):
        native = native_bf16(q.dtype)
        compute = q.dtype if native else torch.float32
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.to(compute), k.to(compute), v.to(compute), 0.0, causal and mask is None,
            attn_mask=None if mask is None else mask.to(compute), scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale, ctx.native, ctx.causal = scale, native, causal and mask is None
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        native = ctx.native and k.shape[2] > CPU_BF16_FP32_BACKWARD_MAX_KEYS
        compute = q.dtype if native else torch.float32
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.to(compute), q.to(compute), k.to(compute), v.to(compute), out.to(compute), lse,
            0.0, ctx.causal, attn_mask=None if mask is None else mask.to(compute), scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
