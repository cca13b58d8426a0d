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

Documents of similar length run as one batched call (`groups`): each is padded at its end with
zeros to the group's longest, which changes nothing for its tokens (causal: no real query sees
a padded key; in the backward the padded queries get a zero gradient and a log-sum-exp of +inf,
so they contribute exact zeros), at most `PAD_WORK` times the group's own score work. Each call
is a parallel region whose threads wait for the slowest: on 2 cores shared with other jobs one
call per document (16) made the packed step cost up to 1.66x the causal one (median 1.06x of CPU
time, bench/bench_packed.py at load 9), against 0.69x quiet.

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


# A group's padded score work (its length squared per document) at most this times its own.
PAD_WORK = 2.0


def groups(runs, split: int | None = None) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """The documents of `runs` (per sample (start, end) ranges) as (padded length, [(sample,
    start, end), ...]) groups: longest first, a document joins the current group while the
    group's padded work stays within `PAD_WORK` of its own; documents longer than `split` never
    share a group with shorter ones (the backward picks its precision by length)."""
    docs = sorted(((end - start, b, start, end) for b, row in enumerate(runs) for start, end in row),
                  reverse=True)
    out: list[tuple[int, list[tuple[int, int, int]]]] = []
    work = 0
    for length, b, start, end in docs:
        if out:
            padded, members = out[-1]
            same_side = split is None or (padded > split) == (length > split)
            if same_side and (len(members) + 1) * padded ** 2 <= PAD_WORK * (work + length ** 2):
                members.append((b, start, end))
                work += length ** 2
                continue
        out.append((length, [(b, start, end)]))
        work = length ** 2
    return out


def _gather(t, members, padded, fill=0.0):
    """The members' slices of t [b, heads, s, ...] stacked, each padded at its end to `padded`."""
    if len(members) == 1:
        b, start, end = members[0]
        return t[b:b + 1, :, start:end]
    out = t.new_full((len(members), t.shape[1], padded) + tuple(t.shape[3:]), fill)
    for i, (b, start, end) in enumerate(members):
        out[i, :, :end - start] = t[b, :, start:end]
    return out


def _scatter(dst, src, members):
    """Write each member's rows of the stacked `src` back into `dst` [b, heads, s, ...]."""
    for i, (b, start, end) in enumerate(members):
        dst[b, :, start:end] = src[i, :, :end - start]


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
        split = cpu_attention.CPU_BF16_FP32_BACKWARD_MAX_KEYS if native else None
        parts = groups(runs, split)
        for padded, members in parts:
            o, l = flash_forward(*(_gather(t, members, padded) for t in (qc, kc, vc)), scale)
            _scatter(out, o, members)
            _scatter(lse, l, members)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.scale, ctx.native = parts, scale, native
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
        for padded, members in ctx.parts:
            compute = q.dtype if ctx.native and padded > limit else torch.float32
            piece = [_gather(t, members, padded) for t in inputs(compute)]
            # padded queries: +inf log-sum-exp, so their attention weights are exact zeros
            g_q, g_k, g_v = flash_backward(*piece, _gather(lse, members, padded, float("inf")),
                                           ctx.scale)
            _scatter(dq, g_q, members)
            _scatter(dk, g_k, members)
            _scatter(dv, g_v, members)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
