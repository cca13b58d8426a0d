"""The short causal depthwise convolution in front of linear token mixers (Gated DeltaNet,
Mamba-2), with its tail: the last kernel - 1 inputs, carried from one call to the next
(generation) or from one context-parallel rank to the next, so a sequence cut anywhere gives
the same output as the whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, t, c], weight [c, 1, k] (nn.Conv1d's), tail [b, k - 1, c] (zeros when None: the
    sequence's start) -> (silu(conv(x)) [b, t, c], the new tail [b, k - 1, c])."""
    b, t, c = x.shape
    k = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(b, k - 1, c)
    full = torch.cat([tail.to(x.dtype), x], dim=1)
    y = F.conv1d(full.transpose(1, 2), weight, bias, groups=c).transpose(1, 2)
    return F.silu(y), full[:, full.shape[1] - (k - 1):]
