"""A column-parallel matmul on a sequence-sharded input that keeps only the shard for backward.

Under sequence parallelism (Korthikanti et al. 2022) the inputs of the QKV and fc1 matmuls arrive
as this rank's [s/tp, b, h] chunk and are all-gathered to [s, b, h] first. Autograd would keep
the gathered tensor for the weight gradient: tp times the memory sequence parallelism set out to
save, in the two largest inputs of every layer. As in Megatron, this keeps the chunk and gathers
again in backward. The gather is launched first and overlaps the input-gradient matmul; the
input gradient's reduce-scatter overlaps the weight-gradient matmul. Inside a compiled layer
(`--compile`) both run as blocking functional collectives in the traced graph instead (the
compiler orders them), since a launched collective's `Work` breaks the graph.

The weight gradient goes straight into the optimizer's bucket when the weight offers
`accumulate_wgrad` (see grad_fusion.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import collectives as C
from .collectives import all_gather, reduce_scatter
from .grad_fusion import weight_grad
from .param_spec import spec_of


def _gather_launch(x_local: torch.Tensor, group) -> tuple[torch.Tensor, C.Pending]:
    if torch.compiler.is_compiling():
        return all_gather(x_local, group, dim=0), C.Pending()
    n = C.group_size(group)
    x_local = x_local.contiguous()
    full = torch.empty((n * x_local.shape[0],) + tuple(x_local.shape[1:]), dtype=x_local.dtype,
                       device=x_local.device)
    return full, C.all_gather_into(full.view(-1), x_local.view(-1), group)


class _SequenceGatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, weight, bias, group):
        ctx.save_for_backward(x_local, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        # compiled: autograd's own weight gradient, which the bucket's hook takes (grad_fusion.linear)
        ctx.accumulate_wgrad = None if torch.compiler.is_compiling() else spec_of(weight).accumulate_wgrad
        return F.linear(all_gather(x_local, group, dim=0), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_local, weight = ctx.saved_tensors
        x_full, gathering = _gather_launch(x_local, ctx.group)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_full = (grad_out @ weight).contiguous()  # partial sums: this rank's weight shard
            grad_x = torch.empty_like(x_local)
            gathering.wait()
            if torch.compiler.is_compiling():
                grad_x, scattering = reduce_scatter(grad_full, ctx.group, dim=0), C.Pending()
            else:
                scattering = C.reduce_scatter_into(grad_x.view(-1), grad_full.view(-1), ctx.group)
        else:
            gathering.wait()
            scattering = C.Pending()
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        x = x_full.view(-1, x_full.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(ctx.accumulate_wgrad, dy.t(), x)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        scattering.wait()
        return grad_x, grad_weight, grad_bias, None


def sequence_gathered_linear(x_local: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, group) -> torch.Tensor:
    """F.linear(all_gather over the sequence (dim 0) of x_local, weight, bias)."""
    return _SequenceGatheredLinear.apply(x_local, weight, bias, group)
