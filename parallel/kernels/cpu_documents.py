"""Packed documents on the CPU: causal attention within each document, every document on aten's
fused CPU flash kernel, all of them inside one autograd node.

`parallel/kernels/attention.py` picks it for causal, aligned documents (queries and keys the same
positions) without ALiBi, a window or dropout. The generic per-document path (a slice of q, k, v
and one SDPA call per document, each its own autograd node) does the same arithmetic, but its
backward costs more than the documents' attention: every slice's gradient is a zero-filled tensor
of the whole q, k or v, added into the whole gradient (16 documents: 16 full-size fills and adds
per tensor per layer, and as many full-size copies for the writes of each document's output).
Here the forward writes each document's output and log-sum-exp into one buffer and the backward
each document's gradients into one buffer. Measured (attention alone, q [1, 8, 2048, 32], GQA
8/4, bench/bench_packed.py's 16 documents, fp32, 2 shared cores): backward 0.056 s against
0.083 s at one thread, 0.24 s against 0.72 s at two under load (each whole-size fill and add is
a parallel region of its own); in bench_packed's whole step at one thread the difference is
within the noise. The kernel takes grouped key/value heads as they are.

Precision as `cpu_attention.CpuLowPrecisionAttention` (measured there): fp32 in fp32; bf16's
forward in bf16 where ATen runs its AVX-512 kernels, its backward in fp32 for documents of up to
`CPU_BF16_FP32_BACKWARD_MAX_KEYS` keys; fp16 in fp32. Autograd saves q, k, v and the output in
their dtype and the fp32 log-sum-exp, as SDPA's own kernel does.
"""
from __future__ import annotations

import torch

from . import cpu_attention

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_forward(q, k, v, scale):
    """(out, lse) of causal q over k, v: aten's fused CPU flash kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                      scale=scale)


def flash_backward(grad, q, k, v, out, lse, scale):
    """(dq, dk, dv) of `flash_forward`'s attention, given its output and log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale)


class CpuDocumentAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v, causal within each document. q [b, heads, s, d], k, v
    [b, kv_heads, s, d]; `runs[i]`: sample i's documents as (start, end) token ranges covering
    the sequence."""

    @staticmethod
    def forward(ctx, q, k, v, runs, scale):
        native = cpu_attention.native_bf16(q.dtype)
        compute = q.dtype if native else torch.float32
        qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)  # the kernel takes grouped heads
        out = q.new_empty(q.shape[:3] + (v.shape[3],), dtype=compute)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for b, row in enumerate(runs):
            for start, end in row:
                o, l = flash_forward(qc[b:b + 1, :, start:end], kc[b:b + 1, :, start:end],
                                     vc[b:b + 1, :, start:end], scale)
                out[b:b + 1, :, start:end] = o
                lse[b:b + 1, :, start:end] = l
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runs, ctx.scale, ctx.native = runs, scale, native
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        limit = cpu_attention.CPU_BF16_FP32_BACKWARD_MAX_KEYS
        dq = q.new_empty(q.shape, dtype=torch.float32)
        dk = k.new_empty(k.shape, dtype=torch.float32)
        dv = v.new_empty(v.shape, dtype=torch.float32)
        cast = {}  # the whole tensors in each compute dtype a document's backward asks for

        def inputs(compute):
            if compute not in cast:
                cast[compute] = [t.to(compute) for t in (grad, q, k, v, out)]
            return cast[compute]
        for b, row in enumerate(ctx.runs):
            for start, end in row:
                compute = q.dtype if ctx.native and end - start > limit else torch.float32
                piece = [t[b:b + 1, :, start:end] for t in inputs(compute)]
                g_q, g_k, g_v = flash_backward(*piece, lse[b:b + 1, :, start:end], ctx.scale)
                dq[b:b + 1, :, start:end] = g_q
                dk[b:b + 1, :, start:end] = g_k
                dv[b:b + 1, :, start:end] = g_v
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
