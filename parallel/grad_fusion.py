"""Weight gradients written straight into the optimizer's gradient buckets.

Megatron's gradient-accumulation fusion: autograd would compute a linear layer's weight gradient
into a fresh tensor, which the bucket's hook then copies (or adds) into the flat gradient buffer:
one extra pass over every weight per micro-batch. When the buffer has the weight's dtype, the
gradient sync sets the parameter's `ParamSpec.accumulate_wgrad(a, b)` (`set_spec`), and
`linear` below calls it from backward: one matmul writes a @ b into the bucket, or adds it there
(addmm) when an earlier micro-batch is already in. Autograd then receives an empty row-sparse gradient (an
exact zero, at no cost), so its bookkeeping and the bucket's readiness hook still run once all
of the weight's gradients are in, and any other gradient of the same weight is added as usual.

Without it (`spec_of(weight).accumulate_wgrad` is None: no ZeRO optimizer, bf16 weights with
fp32 buffers, tests that read `.grad`), `linear` is plain `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .param_spec import spec_of


class _LinearWgradIntoBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # taken now: the tensor saved_tensors hands back (e.g. under recompute) may be another
        # object without the attribute
        ctx.accumulate_wgrad = spec_of(weight).accumulate_wgrad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:  # False for a weight frozen after the optimizer was built
            grad_weight = weight_grad(ctx.accumulate_wgrad, dy.t(), x.reshape(-1, x.shape[-1]))
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def weight_grad(accumulate_wgrad, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient a @ b for autograd, or, when the weight's bucket offers
    `accumulate_wgrad`, written there and an exact zero (or None) for autograd."""
    return a @ b if accumulate_wgrad is None else accumulate_wgrad(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Inside a compiled layer (training/run/compile.py) plain F.linear: the compiler fuses the
    weight gradient itself, and the bucket's hook takes it like any other gradient."""
    if spec_of(weight).accumulate_wgrad is not None and torch.is_grad_enabled() and \
            not torch.compiler.is_compiling():
        return _LinearWgradIntoBucket.apply(x, weight, bias)
    return F.linear(x, weight, bias)
