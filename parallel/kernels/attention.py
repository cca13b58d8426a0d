"""Single-device attention, the kernel picked by device and dtype (`choose_attention`).

    attention(q, k, v, *, causal=True, scale=None, alibi_slopes=None, window=None,
              q_document_ids=None, kv_document_ids=None, q_offset=0, dropout_p=0.0)

q [b, heads, sq, d]; k, v [b, kv_heads, sk, d] (kv_heads divides heads: grouped-query
attention). Query i sits at position `q_offset + i` of the keys (a KV cache: sk - sq). Query at
position p sees key j when (causal) j <= p, (window W, as transformers' Mistral/Qwen2
`sliding_window`) j > p - W, i.e. W keys counting itself, and (packed sequences) key j belongs
to the query's document: `q_document_ids` [b, sq], `kv_document_ids` [b, sk] (default: q's),
integers, each document one run of equal ids. ALiBi adds slope_h * (j - p). A query that sees
no key at all gets zeros.

Paths (`AttentionChoice.path`):
  whole         one SDPA call over the batch; a mask only for ALiBi, a window or q_offset, and
                then one [heads or 1, sq, sk] mask shared by the batch, never one per sample
  varlen        CUDA bf16/fp16 with documents or a window: torch's variable-length flash
                attention over the batch flattened into documents (no mask at all)
  cpu_documents the CPU with causal, aligned documents and no ALiBi, window or dropout: every
                document on aten's CPU flash kernel inside one autograd node
                (`cpu_documents.CpuDocumentAttention`: the work is what the documents need, in
                the backward too)
  per_document  elsewhere, with documents: each document's queries against its own keys
                (block diagonal), so the work is what the documents need
  window_blocks a window without documents elsewhere: queries in blocks of `window`, each
                against the keys its window reaches (about twice the band, not sq x sk)
Each dense piece runs on `AttentionChoice.kernel`:
  cpu_split_precision  CPU bf16/fp16: SDPA's fused CPU kernel, each pass in its faster
                       precision (`cpu_attention.CpuLowPrecisionAttention`, measured)
  sdpa_fused           CUDA bf16/fp16: SDPA preferring flash, then cuDNN, then memory-efficient
  sdpa                 everything else (fp32 anywhere, dropout on the CPU)
  flash_varlen, cpu_flash  the varlen and cpu_documents paths' own kernels
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_attention, cpu_documents
from .choice_log import log_choice_once

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Varlen flash attention (FlashAttention-2) needs Ampere or later.
VARLEN_MIN_CAPABILITY = (8, 0)
# Queries per block on the window path: at least this many, so short windows do not cost a
# kernel launch per handful of queries.
MIN_WINDOW_BLOCK = 128


@dataclass(frozen=True)
class AttentionChoice:
    path: str    # "whole" | "varlen" | "cpu_documents" | "per_document" | "window_blocks"
    kernel: str  # "cpu_split_precision" | "sdpa_fused" | "sdpa" | "flash_varlen" | "cpu_flash"


def varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _capability(device: torch.device, capability):
    if capability is None and device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return capability


def choose_attention(device: torch.device, dtype: torch.dtype, *, documents: bool = False,
                     window: bool = False, alibi: bool = False, dropout_p: float = 0.0,
                     aligned: bool = True, capability: tuple[int, int] | None = None,
                     causal: bool = True) -> AttentionChoice:
    """The path and kernel attention takes on `device` in `dtype`. `aligned`: queries and keys
    are the same positions and documents (no KV cache, no separate kv_document_ids);
    `capability`: a CUDA device's (major, minor), read from the device when None."""
    device = torch.device(device)
    low = dtype in LOW_PRECISION
    if device.type == "cpu" and low and dropout_p == 0.0 and cpu_attention.available():
        kernel = "cpu_split_precision"
    elif device.type == "cuda" and low:
        kernel = "sdpa_fused"
    else:
        kernel = "sdpa"
    if not (documents or window):
        return AttentionChoice("whole", kernel)
    if device.type == "cuda" and low and not alibi and dropout_p == 0.0 and aligned and \
            varlen_available() and _capability(device, capability) >= VARLEN_MIN_CAPABILITY:
        return AttentionChoice("varlen", "flash_varlen")
    if device.type == "cpu" and documents and causal and aligned and not (window or alibi) and \
            dropout_p == 0.0 and dtype in cpu_documents.DTYPES and cpu_attention.available():
        return AttentionChoice("cpu_documents", "cpu_flash")
    return AttentionChoice("per_document" if documents else "window_blocks", kernel)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, alibi_slopes: torch.Tensor | None = None,
              window: int | None = None, q_document_ids: torch.Tensor | None = None,
              kv_document_ids: torch.Tensor | None = None, q_offset: int = 0,
              dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v over the keys each query may see (module docstring)."""
    if window is not None and (not causal or window < 1):
        raise ValueError(f"attention window {window}: a sliding window is causal and at least 1 key")
    if causal and q_offset < 0:
        raise ValueError(f"q_offset {q_offset}: causal queries cannot precede the first key")
    documents = q_document_ids is not None
    if kv_document_ids is not None and not documents:
        raise ValueError("kv_document_ids given without q_document_ids")
    aligned = q_offset == 0 and q.shape[2] == k.shape[2] and (
        kv_document_ids is None or kv_document_ids is q_document_ids)
    choice = choose_attention(q.device, q.dtype, documents=documents, window=window is not None,
                              alibi=alibi_slopes is not None, dropout_p=dropout_p, aligned=aligned,
                              causal=causal)
    if choice.path != "whole":
        log_choice_once(__name__, f"attention with {'documents' if documents else 'a window'} on "
                        f"{q.device.type} {q.dtype}: {choice.path} ({choice.kernel})")
    span = _Span(choice.kernel, causal, scale, alibi_slopes, window, dropout_p)
    if choice.path == "varlen":
        return _varlen(q, k, v, q_document_ids, span)
    if choice.path == "cpu_documents":
        runs = [[(start, end) for _, start, end in _runs(row)] for row in q_document_ids]
        return cpu_documents.CpuDocumentAttention.apply(q, k, v, runs, scale)
    if choice.path == "per_document":
        kv_ids = q_document_ids if kv_document_ids is None else kv_document_ids
        return _per_document(q, k, v, q_document_ids, kv_ids, q_offset, span)
    return span(q, k, v, q_offset, 0)


@dataclass(frozen=True)
class _Span:
    """Attention of a run of queries over a run of keys, at given absolute positions."""
    kernel: str
    causal: bool
    scale: float | None
    slopes: torch.Tensor | None
    window: int | None
    dropout_p: float

    def __call__(self, q, k, v, q_start: int, k_start: int, allowed=None) -> torch.Tensor:
        """q at positions q_start.., k/v at k_start..; `allowed` (bool, broadcastable to
        [1, 1, sq, sk]) or None. With a window, queries run in blocks (one block up to twice
        `max(window, MIN_WINDOW_BLOCK)` queries), each against only the keys it reaches."""
        m = q.shape[2]
        if self.window is None or allowed is not None:
            return self.dense(q, k, v, q_start, k_start, allowed)
        block = max(self.window, MIN_WINDOW_BLOCK)
        block = m if m <= 2 * block else block
        outs = []
        for i in range(0, m, block):
            first = max(q_start + i - self.window + 1 - k_start, 0)
            last = min(q_start + min(i + block, m) - k_start, k.shape[2])  # causal
            outs.append(self.dense(q[:, :, i:i + block], k[:, :, first:last],
                                   v[:, :, first:last], q_start + i, k_start + first))
        return torch.cat(outs, dim=2)

    def dense(self, q, k, v, q_start: int, k_start: int, allowed=None) -> torch.Tensor:
        m, n = q.shape[2], k.shape[2]
        if n == 0:
            return q.new_zeros(q.shape[:3] + (v.shape[3],))
        plain_causal = self.causal and q_start == k_start and m == n and self.window is None
        mask = None
        if self.slopes is not None or allowed is not None or (
                self.causal and not plain_causal) or self.window is not None:
            mask = position_bias(q_start, m, k_start, n, causal=self.causal, window=self.window,
                                 slopes=self.slopes, dtype=q.dtype, device=q.device)
            if allowed is not None:
                mask = mask.masked_fill(~allowed, float("-inf"))
            else:
                mask = mask[None]  # 4-D [1, heads or 1, m, n]: the shape SDPA's fused CPU kernel
                # takes (a 3-D mask falls back to the unfused math path, 1.5x slower here)
        out = run_dense(self.kernel, q, k, v, mask, self.causal and mask is None, self.scale,
                        self.dropout_p)
        if mask is not None and (allowed is not None or q_start < k_start):
            # rows that see no key (only with documents or keys after the queries): zeros,
            # not the kernels' NaN
            seen = torch.isfinite(mask).any(-1, keepdim=True)
            out = out.masked_fill(~seen, 0.0)
        return out


def position_bias(q_start: int, m: int, k_start: int, n: int, *, causal: bool, window, slopes,
                  dtype, device) -> torch.Tensor:
    """Additive bias [heads or 1, m, n] for queries at q_start.. over keys at k_start..: -inf
    where a key is in the future (causal) or `window` or more positions back, plus ALiBi's
    slope * (key - query) where slopes are given."""
    distance = (torch.arange(k_start, k_start + n, device=device)[None, :]
                - torch.arange(q_start, q_start + m, device=device)[:, None]).to(torch.float32)
    bias = distance.new_zeros(distance.shape)[None] if slopes is None \
        else slopes.to(device, torch.float32)[:, None, None] * distance
    hidden = torch.zeros_like(distance, dtype=torch.bool)
    if causal:
        hidden |= distance > 0
    if window is not None:
        hidden |= distance <= -window
    return bias.masked_fill(hidden, float("-inf")).to(dtype)


def run_dense(kernel: str, q, k, v, mask, is_causal: bool, scale, dropout_p: float) -> torch.Tensor:
    """One SDPA-shaped call on `kernel` (`AttentionChoice.kernel`, not flash_varlen)."""
    gqa = q.shape[1] != k.shape[1]
    if kernel == "cpu_split_precision":
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        if qk_dim == v_dim:
            return cpu_attention.CpuLowPrecisionAttention.apply(q, k, v, mask, scale, is_causal)
        # the CPU flash kernel takes one head dim; multi-latent attention's values have their
        # own: zero channels leave q k^T and p v unchanged, the padding is cut from the output
        dim = max(qk_dim, v_dim)
        q, k, v = (t if t.shape[-1] == dim else F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))
        return cpu_attention.CpuLowPrecisionAttention.apply(
            q, k, v, mask, qk_dim ** -0.5 if scale is None else scale, is_causal)[..., :v_dim]
    if kernel == "sdpa_fused":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                          SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, enable_gqa=gqa, scale=scale)


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(id, start, end) of each run of equal values in a 1-D tensor."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return [(d, e - c, e) for d, c, e in zip(values.tolist(), counts.tolist(), ends)]


def _per_document(q, k, v, q_ids, kv_ids, q_offset: int, span: _Span) -> torch.Tensor:
    """Block-diagonal attention: each run of one document's queries against the keys of that
    document (the span from its first to its last key; a mask only if other documents' keys
    sit inside that span)."""
    out = q.new_empty(q.shape[:3] + (v.shape[3],))
    for b in range(q.shape[0]):
        kv_runs: dict[int, tuple[int, int]] = {}
        for d, start, end in _runs(kv_ids[b]):
            first, last = kv_runs.get(d, (start, end))
            kv_runs[d] = (min(first, start), max(last, end))
        for d, start, end in _runs(q_ids[b]):
            first, last = kv_runs.get(d, (0, 0))
            if span.causal:  # keys past the run's last query are never seen
                last = max(min(last, q_offset + end), first)
            allowed = None
            if bool((kv_ids[b, first:last] != d).any()):
                allowed = (kv_ids[b, first:last] == d)[None, None, None, :]
            out[b:b + 1, :, start:end] = span(q[b:b + 1, :, start:end], k[b:b + 1, :, first:last],
                                              v[b:b + 1, :, first:last], q_offset + start, first,
                                              allowed)
    return out


def _varlen(q, k, v, q_ids, span: _Span) -> torch.Tensor:
    """CUDA: the batch flattened to [tokens, heads, d], one flash-attention call over every
    document (or sample, with a window alone) through cumulative sequence lengths."""
    from torch.nn.attention.varlen import varlen_attn
    b, heads, s, d = q.shape
    if q_ids is None:
        lengths = torch.full((b,), s, device=q.device, dtype=torch.int32)
    else:
        new = torch.ones(b, s, dtype=torch.bool, device=q.device)
        new[:, 1:] = q_ids[:, 1:] != q_ids[:, :-1]
        starts = new.flatten().nonzero().flatten()
        lengths = torch.diff(starts, append=starts.new_tensor([b * s])).to(torch.int32)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=q.device)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3])  # noqa: E731
    left = -1 if span.window is None else span.window - 1
    out = varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, scale=span.scale,
                      window_size=(left, 0 if span.causal else -1), enable_gqa=heads != k.shape[1])
    return out.view(b, s, heads, v.shape[3]).transpose(1, 2)
