"""The inner optimizers, written on flat fp32 shards so a bucket's states can live anywhere.

The arithmetic follows torch.optim.AdamW and torch.optim.SGD (single-tensor path) operation
by operation, so a sharded step matches the unsharded reference to rounding. Writing the update
ourselves (rather than wrapping torch.optim) lets offload page one bucket's states in, step it
and page them out again without an optimizer object holding every state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Hyper:
    lr: float
    weight_decay: float
    step: int  # 1-based count of applied (not skipped) steps


class AdamW:
    """Decoupled-weight-decay Adam. Uses torch's fused kernel (one pass over the shard, no
    temporaries, on CPU and GPU) when present; the explicit form below is the same arithmetic."""
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, betas: tuple[float, float], eps: float):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.fused = hasattr(torch, "_fused_adamw_")

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               h: Hyper, grad_mult: float = 1.0) -> None:
        """One step; the gradient is used times `grad_mult` (unscaling x clipping), and may be
        overwritten (it is discarded after the step)."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.fused and param.dtype == grad.dtype == torch.float32:
            # grad_scale divides the gradient inside the kernel, sparing a full-size copy.
            scale = None if grad_mult == 1.0 else torch.tensor(1.0 / grad_mult, device=param.device)
            torch._fused_adamw_([param], [grad], [m], [v], [], [torch.tensor(float(h.step))],
                                lr=h.lr, beta1=self.beta1, beta2=self.beta2,
                                weight_decay=h.weight_decay, eps=self.eps, amsgrad=False,
                                maximize=False, grad_scale=scale, found_inf=None)
            return
        if grad_mult != 1.0:
            grad = grad * grad_mult
        param.mul_(1 - h.lr * h.weight_decay)  # decoupled decay
        m.lerp_(grad, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        step_size = h.lr / (1 - self.beta1 ** h.step)
        denom = (v.sqrt() / math.sqrt(1 - self.beta2 ** h.step)).add_(self.eps)
        param.addcdiv_(m, denom, value=-step_size)


class SGD:
    def __init__(self, momentum: float):
        self.momentum = momentum
        self.state_names = ("momentum_buffer",) if momentum else ()

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               h: Hyper, grad_mult: float = 1.0) -> None:
        if grad_mult != 1.0:
            grad = grad * grad_mult
        if h.weight_decay:
            grad = grad.add(param, alpha=h.weight_decay)  # SGD's decay is L2 on the gradient
        if self.momentum:
            buf = state["momentum_buffer"]
            if h.step == 1:
                buf.copy_(grad)  # torch.optim.SGD starts the buffer at the first gradient
            else:
                buf.mul_(self.momentum).add_(grad)
            grad = buf
        param.add_(grad, alpha=-h.lr)


def build_inner(name: str, betas, eps: float, momentum: float):
    """The elementwise optimizer; under muon it steps the parameters Muon does not suit."""
    return AdamW(betas, eps) if name in ("adamw", "muon") else SGD(momentum)
