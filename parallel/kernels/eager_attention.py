"""Attention written out (scores, softmax, weighted values) for what the fused kernels cannot
express: attention-logit softcapping (Gemma 2/3: scores -> c * tanh(scores / c)) and learned
attention sinks (gpt-oss: one extra logit per head in every softmax, its probability dropped).

    eager_attention(q, k, v, *, scale=None, window=None, q_offset=0, softcap=None, sinks=None)

q [b, heads, sq, d]; k, v [b, kv_heads, sk, d]; causal, the window as in kernels/attention.py;
`sinks` [heads] (this rank's heads). Scores are computed in the inputs' dtype, the softmax in
fp32, as transformers' eager attention does in fp32.
"""
from __future__ import annotations

import torch

from .attention import position_bias


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    scale: float | None = None, window: int | None = None, q_offset: int = 0,
                    softcap: float | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + position_bias(q_offset, q.shape[2], 0, k.shape[2], causal=True,
                                    window=window, slopes=None, dtype=scores.dtype,
                                    device=q.device)[None]
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).reshape(1, heads, 1, 1).expand(*scores.shape[:3], 1)
        both = torch.cat([scores, sink], dim=-1).float()
        both = both - both.max(dim=-1, keepdim=True).values
        probs = torch.softmax(both, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)
