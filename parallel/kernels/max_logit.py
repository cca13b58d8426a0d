"""The largest pre-softmax attention logit of each head, for QK-clip (`parallel/zero/qk_clip.py`).

    head_max_logits(q, k, *, scale=None, causal=True, window=None, q_offset=0,
                    q_document_ids=None, kv_document_ids=None) -> [heads] fp32

The fused kernels (SDPA's flash / memory-efficient paths, the CPU flash kernel, varlen flash
attention) never expose their scores, so the maximum is computed beside them: q k^T * scale in
blocks of queries (no [sq, sk] score matrix of the whole batch is held), masked exactly as
`attention.attention` masks (causal, sliding window, packed documents, a KV cache's offset),
reduced to one value per head over the batch, the queries and the keys each query sees. It is
the q.k part of the logit: an ALiBi bias is not included (QK-clip rescales q and k, which
cannot move the bias). A head whose queries see no key gets -inf. The cost is one more q k^T
per attention forward, paid only while clipping is on.
"""
from __future__ import annotations

import torch

# Scores held at once: queries per block are chosen so b x heads x block x sk stays below this.
BLOCK_SCORES = 1 << 24


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                    causal: bool = True, window: int | None = None, q_offset: int = 0,
                    q_document_ids: torch.Tensor | None = None,
                    kv_document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """max over (batch, query, visible key) of q . k * scale per query head; q [b, heads, sq, d],
    k [b, kv_heads, sk, d] (query head h reads key head h // (heads / kv_heads), as SDPA)."""
    b, heads, sq, d = q.shape
    sk = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(heads // k.shape[1], dim=1) if k.shape[1] != heads else k
    kv_ids = q_document_ids if kv_document_ids is None else kv_document_ids
    key_pos = torch.arange(sk, device=q.device)
    out = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    block = max(1, min(sq, BLOCK_SCORES // max(1, b * heads * sk)))
    kf = k.float()
    for start in range(0, sq, block):
        qb = q[:, :, start:start + block].float()
        scores = torch.matmul(qb, kf.transpose(-1, -2)) * scale  # [b, heads, m, sk]
        pos = torch.arange(start, start + qb.shape[2], device=q.device) + q_offset
        hidden = torch.zeros(pos.numel(), sk, dtype=torch.bool, device=q.device)
        if causal:
            hidden |= key_pos[None, :] > pos[:, None]
        if window is not None:
            hidden |= key_pos[None, :] <= pos[:, None] - window
        mask = hidden[None, None]
        if q_document_ids is not None:
            other = q_document_ids[:, start:start + qb.shape[2], None] != kv_ids[:, None, :]
            mask = mask | other[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out
