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
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, betas: tuple[float, float], eps: float):
        self.beta1, self.beta2 = betas
        self.eps = eps

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               h: Hyper) -> None:
        m, v = state["exp_avg"], state["exp_avg_sq"]
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
               h: Hyper) -> None:
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
    return AdamW(betas, eps) if name == "adamw" else SGD(momentum)
