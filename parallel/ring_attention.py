"""Ring attention (Liu et al. 2023; Megatron-core's context parallelism), exact, with its backward.

Each context rank holds its queries and its keys/values for chunks r and 2C-1-r of the sequence
(`context_parallel.local_positions`). Forward: the key/value block travels around the ring
(`ring_shift`, one `batch_isend_irecv` per step, launched before the block in hand is computed),
and each step's partial attention is merged into the running output by the log-sum-exp rule

    lse = logaddexp(lse_a, lse_b),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).

Backward: the key/value blocks go around the ring again, each with an fp32 accumulator of its
dK/dV that every rank adds its share to; after C steps the accumulator is back with the owner.
Only the local q, k, v, output and log-sum-exp are saved (O(s/C) per rank, nothing quadratic).

With the load-balanced chunks, the blocks need no mask except on the diagonal (step 0, plain
causal); from a rank s < r every query sees the block's first chunk and none of its second, from
a rank s > r only the second local chunk's queries see the block, all of it. So each off-diagonal
step computes exactly half a block, on every rank. ALiBi adds slope x (key - query) from the
absolute positions of both blocks. Grouped-query attention keeps queries grouped
[b, kv_heads, q_per_kv, s, d] against keys [b, kv_heads, 1, s, d], so only key/value heads travel.
"""
from __future__ import annotations

import math

import torch

from . import collectives as C
from .context_parallel import local_positions


def _scores(q, k, scale, bias):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if bias is None else s + bias


def _block_forward(q, k, v, scale, bias):
    """Attention of q [b, g, qg, m, d] over one block k, v [b, g, 1, n, d]: (out, lse)."""
    s = _scores(q, k, scale, bias)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _block_backward(q, k, v, do, lse, delta, scale, bias):
    """Gradients of one block given the final lse and delta = rowsum(dO * O): (dq, dk, dv)."""
    p = torch.exp(_scores(q, k, scale, bias) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2, keepdim=True)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2, keepdim=True) * scale
    return dq, dk, dv


def _merge(out, lse, o, l, rows: slice) -> None:
    """Fold a partial result (o, l) for query rows `rows` into the running (out, lse)."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new)[..., None] \
        + o * torch.exp(l - new)[..., None]
    lse[..., rows] = new


class _Ring:
    """The static plan of one ring: which rows and columns each step computes, and their bias."""

    def __init__(self, length: int, cp: int, rank: int, slopes, device):
        self.cp, self.rank, self.half = cp, rank, length // 2
        self.slopes = slopes  # [g, qg, 1, 1] fp32 or None
        self.pos = [local_positions(length, cp, r, device).float() for r in range(cp)]

    def source(self, step: int) -> int:
        return (self.rank - step) % self.cp

    def block(self, step: int) -> tuple[slice, slice, torch.Tensor | None]:
        """(query rows, key columns, additive bias or None) of step `step`."""
        src, h = self.source(step), self.half
        if step == 0:
            rows, cols = slice(None), slice(None)
        elif src < self.rank:
            rows, cols = slice(None), slice(0, h)
        else:
            rows, cols = slice(h, None), slice(None)
        qpos, kpos = self.pos[self.rank][rows], self.pos[src][cols]
        distance = kpos[None, :] - qpos[:, None]
        bias = None if self.slopes is None else self.slopes * distance
        if step == 0:
            causal = torch.zeros_like(distance).masked_fill(distance > 0, float("-inf"))
            bias = causal if bias is None else bias + causal
        return rows, cols, bias


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, group):
        b, heads, n, d = q.shape
        g = k.shape[1]
        cp, rank = C.group_size(group), C.group_rank(group)
        scale = 1.0 / math.sqrt(d)
        qf = q.float().reshape(b, g, heads // g, n, d)
        ring = _Ring(n, cp, rank, None if slopes is None else
                     slopes.float().reshape(g, heads // g, 1, 1), q.device)
        kv = torch.stack([k, v]).float().unsqueeze(3).contiguous()  # [2, b, g, 1, n, d]
        out = lse = None
        for step in range(cp):
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                pending = C.ring_shift(kv, incoming, group, tag=0)
            rows, cols, bias = ring.block(step)
            o, l = _block_forward(qf[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                  scale, bias)
            if step == 0:
                out, lse = o, l
            else:
                _merge(out, lse, o, l, rows)
            if step < cp - 1:
                pending.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.group, ctx.scale = ring, group, scale
        return out.reshape(b, heads, n, d)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, group, scale = ctx.ring, ctx.group, ctx.scale
        b, heads, n, d = q.shape
        g, cp = k.shape[1], ring.cp
        qf = q.float().reshape(b, g, heads // g, n, d)
        do = grad_out.float().reshape(b, g, heads // g, n, d)
        delta = (do * out.float()).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float().unsqueeze(3).contiguous()
        dkv = torch.zeros_like(kv)  # travels with kv; collects every rank's share
        for step in range(cp):
            if step < cp - 1:
                kv_in = torch.empty_like(kv)
                kv_pending = C.ring_shift(kv, kv_in, group, tag=1)
            rows, cols, bias = ring.block(step)
            dq_b, dk_b, dv_b = _block_backward(qf[..., rows, :], kv[0][..., cols, :],
                                               kv[1][..., cols, :], do[..., rows, :],
                                               lse[..., rows], delta[..., rows], scale, bias)
            dq[..., rows, :] += dq_b
            if step > 0:
                dkv_pending.wait()
                dkv = dkv_in
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            dkv_in = torch.empty_like(dkv)
            dkv_pending = C.ring_shift(dkv, dkv_in, group, tag=2)
            if step < cp - 1:
                kv_pending.wait()
                kv = kv_in
        dkv_pending.wait()  # after C shifts, the accumulator of this rank's own keys and values
        dkv = dkv_in.squeeze(3)
        return (dq.reshape(b, heads, n, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the context group's whole sequence (shapes: `context_attention`)."""
    return RingAttention.apply(q, k, v, alibi_slopes, group)
