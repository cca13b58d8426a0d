"""Shape-only stand-ins for the kernels whose `meta` version keeps other tensors for backward
than the device's kernels do (tools/dry_run.py measures activation memory on meta tensors).

On meta, SDPA takes its math path (fp32 copies, the attention scores) and dropout keeps a mask in
the input's dtype; on CPUs and GPUs the fused attention kernels keep q, k, v, the output, the
fp32 log-sum-exp and the additive mask if any, and dropout a 1-byte mask.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class _FusedAttentionShapes(torch.autograd.Function):
    """What a fused attention kernel (FlashAttention on GPUs, SDPA's flash kernel on CPUs) keeps
    for backward: q, k, v (GQA's fewer key/value heads as they are), its output, the fp32
    log-sum-exp of each row, and the additive mask when there is one (ALiBi). On meta tensors
    SDPA takes its math path, which would keep fp32 copies and the attention scores instead."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # v's head dim (MLA's differs from q's)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _DropoutShapes(torch.autograd.Function):
    """Dropout keeps a 1-byte mask on CPUs and GPUs; on meta it would keep one in the input's
    dtype."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


@contextlib.contextmanager
def device_kernels_on_meta():
    """Meta-tensor attention and dropout keep what the device kernels keep (forward and
    recompute): `_FusedAttentionShapes`, `_DropoutShapes`."""
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def attention(q, k, v, attn_mask=None, **kwargs):
        if q.is_meta:
            return _FusedAttentionShapes.apply(q, k, v, attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    def drop(x, p=0.5, training=True, inplace=False):
        if x.is_meta and training and p > 0:
            return _DropoutShapes.apply(x)
        return dropout(x, p, training, inplace)
    F.scaled_dot_product_attention, F.dropout = attention, drop
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
