"""The short causal depthwise convolution in front of linear token mixers (Gated DeltaNet,
Mamba-2), with its tail: the last kernel - 1 inputs, carried from one call to the next
(generation) or from one context-parallel rank to the next, so a sequence cut anywhere gives
the same output as the whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tail: torch.Tensor | None = None, resets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, t, c], weight [c, 1, k] (nn.Conv1d's), tail [b, k - 1, c] (zeros when None: the
    sequence's start) -> (silu(conv(x)) [b, t, c], the new tail [b, k - 1, c]). `resets` [b, t]
    bool (True at a packed document's first token): a token sees no input of an earlier document
    (nor the tail, when the first token starts one); the new tail holds zeros in place of the
    inputs before the last document start in it."""
    b, t, c = x.shape
    k = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(b, k - 1, c)
    full = torch.cat([tail.to(x.dtype), x], dim=1)
    if resets is None:
        y = F.conv1d(full.transpose(1, 2), weight, bias, groups=c).transpose(1, 2)
    else:
        doc = F.pad(resets.long().cumsum(1), (k - 1, 0))       # the tail is document 0
        same = doc.unfold(1, k, 1) == doc[:, k - 1:, None]     # [b, t, k]: tap in t's document
        taps = full.unfold(1, k, 1) * same[:, :, None, :].to(x.dtype)   # [b, t, c, k]
        y = (taps * weight[:, 0]).sum(-1)
        y = y if bias is None else y + bias
        # the tail keeps only the last document's inputs: a continuation (the next context rank,
        # the next generation step) must not see an earlier document's through it
        last = doc[:, full.shape[1] - (k - 1):]
        kept = (last == doc[:, -1:]).to(x.dtype)[..., None]
        return F.silu(y), full[:, full.shape[1] - (k - 1):] * kept
    return F.silu(y), full[:, full.shape[1] - (k - 1):]
