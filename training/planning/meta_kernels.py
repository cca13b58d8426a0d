"""Shape-only stand-ins for the kernels whose `meta` version keeps other tensors for backward
than the device's kernels do (tools/dry_run.py measures activation memory on meta tensors), and
for the data-dependent shapes of MoE token dispatch, which meta tensors cannot have
(`balanced_routing`: balanced routing's).

On meta, SDPA takes its math path (fp32 copies, the attention scores) and dropout keeps a mask in
the input's dtype; on CPUs and GPUs the fused attention kernels keep q, k, v, the output, the
fp32 log-sum-exp and the additive mask if any, and dropout a 1-byte mask.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megazoo.models.moe import moe_layers
from megazoo.parallel import collectives as C
from megazoo.parallel.expert_parallel import TokenDispatcher


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


def balanced_counts(assignments: int, num_experts: int) -> list[int]:
    """Balanced routing's assignments per expert: as even as whole numbers allow (the first
    `assignments % num_experts` experts one more)."""
    base, extra = divmod(assignments, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


class BalancedDispatcher(TokenDispatcher):
    """The token dispatch of a MoE layer on meta tensors (the dry run), as if routing were
    balanced: every expert gets an even share of the rank's T * k assignments, from every rank
    alike (each rank's T is the same in a training step). The real routing has no values on meta,
    so the two data-dependent steps of `TokenDispatcher` take balanced routing's sizes; the sort,
    the all-to-alls (on the fake group), the reorder and the combine run as they are, and so
    keep for backward what they keep on a device. A balanced load is the planner's assumption
    too (training/planning/memory.py); a skewed one is larger on the busiest ranks."""

    def __init__(self, group, num_experts: int):
        super().__init__(group)
        self.num_experts = num_experts

    def keep(self, order, fits, counts, capacity):
        kept = sum(min(c, capacity) for c in balanced_counts(order.numel(), self.num_experts))
        return order[:kept].clone()

    def exchange_counts(self, counts, rows):
        ep = C.group_size(self.group)
        local = counts.numel() // ep
        per_expert = balanced_counts(rows, counts.numel())
        send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
        received = C.all_to_all_rows(counts.view(ep, local), self.group, [1] * ep, [1] * ep)
        return received, send, [send[C.group_rank(self.group)]] * ep


@contextlib.contextmanager
def balanced_routing(chunks):
    """Every MoE layer of `chunks` dispatches tokens as `BalancedDispatcher` does, and
    `torch.bincount` has a meta kernel (the bins' count, `minlength`: the router's expert ids
    and the sequence-wise aux loss's keys are below it) while the block runs."""
    layers = [layer for chunk in chunks for layer in moe_layers(chunk)]
    real = [layer.dispatcher for layer in layers]
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - removed on exit below

    def bincount(x, weights=None, minlength=0):
        if minlength < 1:
            raise NotImplementedError("torch.bincount on meta tensors needs minlength (the "
                                      "number of bins): its output size depends on the values")
        return x.new_empty(minlength, dtype=torch.int64 if weights is None else weights.dtype)

    library.impl("bincount", bincount, "Meta")
    for layer, dispatcher in zip(layers, real):
        layer.dispatcher = BalancedDispatcher(dispatcher.group, layer.num_experts)
    try:
        yield
    finally:
        for layer, dispatcher in zip(layers, real):
            layer.dispatcher = dispatcher
        library._destroy()  # noqa: SLF001 - the only way to unregister a kernel
