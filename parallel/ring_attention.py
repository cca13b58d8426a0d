"""Ring attention (Liu et al. 2023; Megatron-core's context parallelism), exact, with its backward.

Each context rank holds its queries and its keys/values for chunks r and 2C-1-r of the sequence
(`context_split.local_positions`). Forward: the key/value block travels around the ring
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
absolute positions of both blocks. Only key/value heads travel (grouped-query attention).

Packed documents are read from the whole sequence's ids (`Documents.ids`, on every rank). A
rank's tokens are two chunks in increasing positions, so each document's queries, and each
document's keys, are one run of a block's rows or columns: on the CPU's fused kernel a block
with documents runs as its documents' sub-blocks (`DocumentBlocks`: each document's query run
over the same document's key run; causal on the diagonal step, whole elsewhere), no [m, n] mask;
with ALiBi, a window, ids that are not runs, or elsewhere, as a per-sample -inf bias across
documents. A query row that sees no key of a block gets a zero output and log-sum-exp -inf
there, which the merge ignores.

Each block runs on the device's fused kernel where it has one (`kernels/attention_block.py`:
aten's CPU flash kernel in fp32; FlashAttention-2 on CUDA in bf16/fp16 without ALiBi), whose
backward takes the final output and log-sum-exp, so no block materialises its scores; else as
plain fp32 matmuls (`block_forward`/`block_backward`, tested against each other). K/V travel in
`ring_compute_dtype`: fp32 on the CPU (as measured), the activation dtype on a GPU; partial
outputs, log-sum-exps and the travelling dK/dV accumulator stay fp32. K and V travel as one
flat buffer (`_pack`), so V's head dim may differ from Q's and K's (multi-latent attention), and
the softmax scale is the caller's (MLA's YaRN correction) or 1/sqrt(Q's head dim).
"""
from __future__ import annotations

import functools
import math

import torch

from . import collectives as C
from .context_split import local_positions
from .kernels.attention_block import (choose_block_kernel, fused_block_backward, fused_block_forward,
                                      ring_compute_dtype)


def _fused(device) -> bool:
    """Whether blocks may take the device's fused kernel (`choose_block_kernel`); the tests
    switch it off to check the matmul path against it."""
    return True


class DocumentBlocks:
    """A block's packed documents, from its rows' documents [b, m] and columns' documents
    [b, n]: `same` [b, m, n] (query row and key column in one document), and `pairs[i]`, sample
    i's (row start, row end, column start, column end) of each document with queries and keys
    in the block, or None where a document's ids are not one run (read from the ids once, when
    a kernel asks: the matmul path never does)."""

    def __init__(self, q_docs: torch.Tensor, k_docs: torch.Tensor):
        self.q_docs, self.k_docs = q_docs, k_docs
        self.same = q_docs[:, :, None] == k_docs[:, None, :]

    @functools.cached_property
    def pairs(self) -> list[list[tuple[int, int, int, int]]] | None:
        pairs = []
        for qd, kd in zip(self.q_docs, self.k_docs):
            q_runs, k_runs = _runs(qd), _runs(kd)
            if q_runs is None or k_runs is None:
                return None
            pairs.append([(*q_runs[d], *k_runs[d]) for d in q_runs if d in k_runs])
        return pairs

    def dense(self) -> torch.Tensor:
        """The per-sample bias [b, 1, m, n]: 0 within a document, -inf across."""
        zeros = torch.zeros(self.same.shape, dtype=torch.float32, device=self.same.device)
        return zeros.masked_fill(~self.same, float("-inf"))[:, None]


def _runs(ids: torch.Tensor) -> dict[int, tuple[int, int]] | None:
    """{id: (start, end)} of a 1-D tensor whose every value is one run; None if one is not."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    if len(values) != len(set(values.tolist())):
        return None
    ends = counts.cumsum(0).tolist()
    return {d: (e - c, e) for d, c, e in zip(values.tolist(), counts.tolist(), ends)}


def _block_kernel(q, bias) -> str:
    if not _fused(q.device):
        return "matmul"
    if isinstance(bias, DocumentBlocks):  # the CPU flash kernel runs its documents' sub-blocks
        fused = choose_block_kernel(q.device, q.dtype, bias=False) == "cpu_flash" and \
            bias.pairs is not None
        return "cpu_documents" if fused else "matmul"
    if bias is not None and bias.dim() == 4:
        return "matmul"  # a per-sample bias (packed documents with ALiBi or a window)
    return choose_block_kernel(q.device, q.dtype, bias=bias is not None)


def _documents_forward(q, k, v, scale, docs: DocumentBlocks, causal: bool):
    """(out, lse) of a block as its documents' sub-blocks on the CPU flash kernel; rows whose
    document has no key in the block: 0 and -inf."""
    out = q.new_zeros(q.shape[:3] + (v.shape[3],))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for b, pairs in enumerate(docs.pairs):
        for r0, r1, c0, c1 in pairs:
            o, l = fused_block_forward("cpu_flash", q[b:b + 1, :, r0:r1], k[b:b + 1, :, c0:c1],
                                       v[b:b + 1, :, c0:c1], scale, None, causal)
            out[b:b + 1, :, r0:r1] = o
            lse[b:b + 1, :, r0:r1] = l
    return out, lse


def _documents_backward(q, k, v, do, out, lse, scale, docs: DocumentBlocks, causal: bool):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for b, pairs in enumerate(docs.pairs):
        for r0, r1, c0, c1 in pairs:
            rows, cols = (slice(b, b + 1), slice(None), slice(r0, r1)), \
                (slice(b, b + 1), slice(None), slice(c0, c1))
            g_q, g_k, g_v = fused_block_backward(
                "cpu_flash", q[rows], k[cols], v[cols], do[rows].contiguous(),
                out[rows].contiguous(), lse[rows].contiguous(), scale, None, causal)
            dq[rows] += g_q
            dk[cols] += g_k
            dv[cols] += g_v
    return dq, dk, dv


def _scores(q, k, scale, bias):
    g = k.shape[1]
    qg = q.reshape(q.shape[0], g, q.shape[1] // g, q.shape[2], q.shape[3])
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if bias is None:
        return s
    if bias.dim() == 4:  # [b, heads or 1, m, n]: per sample (packed documents)
        return s + (bias[:, :, None] if bias.shape[1] == 1 else bias.reshape((bias.shape[0], g, -1)
                                                                           + bias.shape[-2:]))
    return s + (bias if bias.shape[0] == 1 else bias.reshape((1, g, -1) + bias.shape[-2:]))


def block_forward(q, k, v, scale, bias, causal: bool):
    """Attention of q [b, heads, m, d] over one block k [b, kv_heads, n, d], v [b, kv_heads,
    n, dv] (out has v's head dim, which may differ: multi-latent attention), with an
    additive bias [heads or 1, m, n] and/or a causal (square, top-left) mask: (out, lse [b,
    heads, m] fp32); out in fp32 on the matmul path, in the inputs' dtype on a fused one."""
    b, heads, m, d = q.shape
    kernel = _block_kernel(q, bias)
    if kernel == "cpu_documents":
        return _documents_forward(q, k, v, scale, bias, causal)
    if isinstance(bias, DocumentBlocks):
        bias = bias.dense()
    if kernel != "matmul":
        mask = None if bias is None else _causal(bias) if causal else bias
        return fused_block_forward(kernel, q, k, v, scale, None if mask is None else mask[None],
                                   causal)
    q, k, v = q.float(), k.float(), v.float()
    if causal:
        bias = _causal(bias if bias is not None else q.new_zeros(1, m, k.shape[2]))
    s = _scores(q, k, scale, bias)
    lse = torch.logsumexp(s, dim=-1)
    # a query that sees no key of this block (another document): lse -inf, output 0
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.matmul(torch.exp(s - safe[..., None]), v.unsqueeze(2))
    return out.reshape(b, heads, m, v.shape[3]), lse.reshape(b, heads, m)


def block_backward(q, k, v, do, out, lse, scale, bias, causal: bool):
    """Gradients of one block given the final output and lse of its query rows: (dq, dk, dv)."""
    b, heads, m, d = q.shape
    g = k.shape[1]
    kernel = _block_kernel(q, bias)
    if kernel == "cpu_documents":
        return _documents_backward(q, k, v, do, out, lse, scale, bias, causal)
    if isinstance(bias, DocumentBlocks):
        bias = bias.dense()
    if kernel != "matmul":
        mask = None if bias is None else _causal(bias) if causal else bias
        return fused_block_backward(kernel, q, k, v, do, out, lse, scale,
                                    None if mask is None else mask[None], causal)
    q, k, v, do, out = q.float(), k.float(), v.float(), do.float(), out.float()
    if causal:
        bias = _causal(bias if bias is not None else q.new_zeros(1, m, k.shape[2]))
    group = lambda t: t.reshape(b, g, heads // g, m, -1)  # noqa: E731
    p = torch.exp(_scores(q, k, scale, bias) - group(lse[..., None]))
    do_g = group(do)
    delta = (do_g * group(out)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do_g).sum(2)
    ds = p * (torch.matmul(do_g, v.unsqueeze(2).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), group(q)).sum(2) * scale
    return dq.reshape(b, heads, m, d), dk, dv


def _causal(bias):
    """`bias` with -inf above the diagonal (square blocks: local positions increase)."""
    m, n = bias.shape[-2:]
    return bias.masked_fill(torch.ones(m, n, dtype=torch.bool, device=bias.device).triu(1),
                            float("-inf"))


def _merge(out, lse, o, l, rows: slice) -> None:
    """Fold a partial result (o, l) for query rows `rows` into the running (out, lse)."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new)[..., None] \
        + o * torch.exp(l - new)[..., None]
    lse[..., rows] = new


class _Ring:
    """The static plan of one ring: which rows and columns each step computes, and their bias.

    With a sliding `window` a key `window` or more positions before a query is hidden (a -inf
    bias); a step whose every key is that far from every query is skipped (`block` gives None),
    so a rank computes only the blocks the window reaches."""

    def __init__(self, length: int, cp: int, rank: int, slopes, device, window: int | None = None,
                 document_ids=None):
        self.cp, self.rank, self.half, self.window = cp, rank, length // 2, window
        self.slopes = slopes  # [heads, 1, 1] fp32 or None
        index = [local_positions(length, cp, r, device) for r in range(cp)]
        self.pos = [i.float() for i in index]
        # each rank's tokens' documents [b, length] (from the whole sequence's ids), or None
        self.docs = None if document_ids is None else [document_ids.index_select(1, i) for i in index]

    def source(self, step: int) -> int:
        return (self.rank - step) % self.cp

    def block(self, step: int):
        """(query rows, key columns, bias or None, rows that see a key or None) of step `step`
        (causal iff step 0), or None when the window reaches none of the block."""
        src, h = self.source(step), self.half
        if step == 0:
            rows, cols = slice(None), slice(None)
        elif src < self.rank:
            rows, cols = slice(None), slice(0, h)
        else:
            rows, cols = slice(h, None), slice(None)
        if self.slopes is None and self.window is None and self.docs is None:
            return rows, cols, None, None
        if self.slopes is None and self.window is None:  # documents alone: no mask needed
            return rows, cols, DocumentBlocks(self.docs[self.rank][:, rows],
                                              self.docs[src][:, cols]), None
        qpos, kpos = self.pos[self.rank][rows], self.pos[src][cols]
        distance = kpos[None, :] - qpos[:, None]
        bias = distance.new_zeros((1,) + distance.shape) if self.slopes is None \
            else self.slopes * distance
        seen = None
        if self.window is not None:
            hidden = distance <= -self.window
            if step == 0:
                hidden |= distance > 0
            seen = ~hidden.all(-1)
            if not bool(seen.any()):
                return None
            bias = bias.masked_fill(hidden, float("-inf"))
        if self.docs is not None:  # [b, 1, m, n]: -inf across documents
            same = self.docs[self.rank][:, rows, None] == self.docs[src][:, None, cols]
            mask = torch.zeros(same.shape, dtype=torch.float32, device=same.device)
            bias = mask.masked_fill(~same, float("-inf"))[:, None] + bias[None]
        return rows, cols, bias, seen


def _pack(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k and v in one flat buffer, one message per ring step (their head dims may differ)."""
    return torch.cat([k.reshape(-1).to(dtype), v.reshape(-1).to(dtype)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The k and v views of a `_pack`ed buffer (or of a gradient buffer shaped like one)."""
    n = math.prod(k_shape)
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, group, window, document_ids, scale):
        b, heads, n, d = q.shape
        cp, rank = C.group_size(group), C.group_rank(group)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        compute = ring_compute_dtype(q.device, q.dtype)
        qf = q.to(compute)
        ring = _Ring(n, cp, rank, None if slopes is None else slopes.float()[:, None, None],
                     q.device, window, document_ids)
        kv = _pack(k, v, compute)
        out = lse = None
        for step in range(cp):
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                pending = C.ring_shift(kv, incoming, group, tag=0)
            plan = ring.block(step)
            if plan is not None:  # (step 0 always computes: every query sees itself)
                rows, cols, bias, seen = plan
                kb, vb = _unpack(kv, k.shape, v.shape)
                o, l = block_forward(qf[..., rows, :].contiguous(), kb[..., cols, :].contiguous(),
                                     vb[..., cols, :].contiguous(), scale, bias, step == 0)
                o, l = o.float(), l.float()
                if seen is not None:  # rows the window hides the whole block from add nothing
                    o = o.masked_fill(~seen[:, None], 0.0)
                    l = l.masked_fill(~seen, float("-inf"))
                if step == 0:
                    out, lse = o.clone(), l.clone()
                else:
                    _merge(out, lse, o, l, rows)
            if step < cp - 1:
                pending.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.group, ctx.scale, ctx.compute = ring, group, scale, compute
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, group, scale, cp = ctx.ring, ctx.group, ctx.scale, ctx.ring.cp
        compute = ctx.compute
        qf, do, of = q.to(compute), grad_out.to(compute).contiguous(), out.to(compute)
        dq = torch.zeros_like(qf, dtype=torch.float32)
        kv = _pack(k, v, compute)
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # travels with kv; collects every rank's share
        for step in range(cp):
            if step < cp - 1:
                kv_in = torch.empty_like(kv)
                kv_pending = C.ring_shift(kv, kv_in, group, tag=1)
            plan = ring.block(step)
            if plan is not None:
                rows, cols, bias, seen = plan
                kb, vb = _unpack(kv, k.shape, v.shape)
                dq_b, dk_b, dv_b = block_backward(
                    qf[..., rows, :].contiguous(), kb[..., cols, :].contiguous(),
                    vb[..., cols, :].contiguous(), do[..., rows, :].contiguous(),
                    of[..., rows, :].contiguous(), lse[..., rows].contiguous(), scale, bias,
                    step == 0)
                if seen is not None:
                    dq_b = dq_b.masked_fill(~seen[:, None], 0.0)
                dq[..., rows, :] += dq_b
            if step > 0:
                dkv_pending.wait()
                dkv = dkv_in
            if plan is not None:
                dk, dv = _unpack(dkv, k.shape, v.shape)
                dk[..., cols, :] += dk_b
                dv[..., cols, :] += dv_b
            dkv_in = torch.empty_like(dkv)
            dkv_pending = C.ring_shift(dkv, dkv_in, group, tag=2)
            if step < cp - 1:
                kv_pending.wait()
                kv = kv_in
        dkv_pending.wait()  # after C shifts, the accumulator of this rank's own keys and values
        dk, dv = _unpack(dkv_in, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   alibi_slopes: torch.Tensor | None = None, window: int | None = None,
                   document_ids: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention over the context group's whole sequence (shapes: `context_attention`),
    within a sliding `window` when given; `document_ids` [b, s]: the whole sequence's documents
    (no query sees another document); `scale`: the softmax scale (None: 1/sqrt(q's head dim))."""
    return RingAttention.apply(q, k, v, alibi_slopes, group, window, document_ids, scale)
