"""parallel/kernels: which kernel each (device, dtype) gets, as data (no GPU needed), and every
CPU kernel against a plain fp32 reference (an explicit dense masked softmax, written here).
The MoE grouped expert matmul: test_kernels_grouped_matmul.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megazoo.parallel.kernels.cpu_attention as cpu_attention
from megazoo.parallel.kernels.attention import AttentionChoice, attention, choose_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H100, A100, V100 = (9, 0), (8, 0), (7, 0)


def reference_attention(q, k, v, *, causal=True, scale=None, slopes=None, window=None,
                        q_ids=None, kv_ids=None, q_offset=0):
    """fp32, dense: scores, an explicit boolean mask of what each query may see, softmax."""
    q, k, v = q.double(), k.double(), v.double()
    heads, groups = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    qpos = torch.arange(q.shape[2])[:, None] + q_offset
    kpos = torch.arange(k.shape[2])[None, :]
    if slopes is not None:
        scores = scores + slopes.double()[:, None, None] * (kpos - qpos)
    seen = torch.ones(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        seen &= kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    if q_ids is not None:
        kv_ids = q_ids if kv_ids is None else kv_ids
        seen &= (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v).float()


def _packed_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in lengths])


# ---- dispatch, as data ---------------------------------------------------------------------

def test_attention_dispatch_by_device_and_dtype():
    c = choose_attention
    assert c(CPU, BF16) == c(CPU, FP16) == AttentionChoice("whole", "cpu_split_precision")
    assert c(CPU, FP32) == AttentionChoice("whole", "sdpa")
    assert c(CPU, BF16, dropout_p=0.1) == AttentionChoice("whole", "sdpa")
    assert c(CUDA, BF16, capability=H100) == AttentionChoice("whole", "sdpa_fused")
    assert c(CUDA, FP32, capability=H100) == AttentionChoice("whole", "sdpa")
    # documents / windows: varlen flash on CUDA where it runs, block-diagonal elsewhere
    assert c(CUDA, BF16, documents=True, capability=H100) == AttentionChoice("varlen", "flash_varlen")
    assert c(CUDA, FP16, window=True, capability=A100) == AttentionChoice("varlen", "flash_varlen")
    assert c(CUDA, BF16, documents=True, capability=V100) == \
        AttentionChoice("per_document", "sdpa_fused")
    assert c(CUDA, BF16, documents=True, alibi=True, capability=H100).path == "per_document"
    assert c(CUDA, BF16, documents=True, aligned=False, capability=H100).path == "per_document"
    assert c(CUDA, BF16, window=True, dropout_p=0.1, capability=H100) == \
        AttentionChoice("window_blocks", "sdpa_fused")
    assert c(CUDA, FP32, documents=True, capability=H100) == AttentionChoice("per_document", "sdpa")
    # causal aligned documents on the CPU: every document on the flash kernel in one node
    assert c(CPU, BF16, documents=True) == c(CPU, FP32, documents=True) == \
        AttentionChoice("cpu_documents", "cpu_flash")
    for other in (dict(causal=False), dict(alibi=True), dict(window=True), dict(aligned=False)):
        assert c(CPU, BF16, documents=True, **other) == \
            AttentionChoice("per_document", "cpu_split_precision"), other
    assert c(CPU, BF16, documents=True, dropout_p=0.1) == AttentionChoice("per_document", "sdpa")
    assert c(CPU, torch.float64, documents=True) == AttentionChoice("per_document", "sdpa")
    assert c(CPU, FP32, window=True) == AttentionChoice("window_blocks", "sdpa")


def test_window_means_transformers_sliding_window():
    """`window` W is transformers' Mistral/Qwen2 `sliding_window`: W keys counting the query."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from megazoo.parallel.kernels.attention import position_bias
    q_idx, kv_idx = torch.arange(12)[:, None], torch.arange(12)[None, :]
    for w in (1, 3, 12):
        want = sliding_window_causal_mask_function(w)(0, 0, q_idx, kv_idx)
        got = position_bias(0, 12, 0, 12, causal=True, window=w, slopes=None, dtype=FP32,
                            device=CPU)[0].isfinite()
        assert torch.equal(got, want) and int(got[-1].sum()) == w


# ---- every CPU path against the reference --------------------------------------------------

ATTENTION_CASES = {  # name: (attention kwargs, q length, k length)
    "causal": (dict(), 40, 40),
    "not causal": (dict(causal=False), 40, 40),
    "alibi, scale": (dict(alibi=True, scale=0.3), 40, 40),
    "kv cache": (dict(q_offset=30, alibi=True), 10, 40),
    "window": (dict(window=7), 40, 40),
    "window blocks": (dict(window=5), 300, 300),  # > 2 x 128 queries: block by block
    "window, alibi, kv cache": (dict(window=9, alibi=True, q_offset=290), 10, 300),
    "documents": (dict(docs=[[5, 20, 15], [40]]), 40, 40),
    "documents, alibi, window": (dict(docs=[[5, 20, 15], [1, 39]], alibi=True, window=6), 40, 40),
    "documents, kv cache": (dict(docs=[[5, 20, 15], [12, 28]], q_offset=32), 8, 40),
    "documents split in two runs": (dict(ids=[[0] * 10 + [1] * 10 + [0] * 20] * 2), 40, 40),
}


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
def test_attention_paths_equal_the_dense_reference(dtype):
    """Each case through the CPU kernel of its dtype (fp32: SDPA; bf16/fp16: the pass-precision
    split), forward and the three gradients, against fp64-accumulated dense masked softmax."""
    g = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    tol = 1e-5 if dtype == FP32 else 1e-2  # low precision: relative to the norm (rounding ~0.3%)
    for name, (case, m, n) in ATTENTION_CASES.items():
        case = dict(case)
        ids = None
        if "docs" in case:
            ids = _packed_ids(case.pop("docs"))
        elif "ids" in case:
            ids = torch.tensor(case.pop("ids"))
        alibi = slopes if case.pop("alibi", False) else None
        q0 = torch.randn(2, 4, m, 8, generator=g).to(dtype)
        k0, v0 = (torch.randn(2, 2, n, 8, generator=g).to(dtype) for _ in range(2))
        r = torch.randn(2, 4, m, 8, generator=g)
        q_ids = kv_ids = None
        if ids is not None:
            kv_ids, q_ids = ids, ids[:, n - m:]
        results = []
        for fn in (attention, reference_attention):
            q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
            if fn is attention:
                out = attention(q, k, v, alibi_slopes=alibi, q_document_ids=q_ids,
                                kv_document_ids=kv_ids, **case)
                assert out.dtype == dtype
            else:
                out = reference_attention(q, k, v, slopes=alibi, q_ids=q_ids, kv_ids=kv_ids,
                                          **case)
            (out.float() * r).sum().backward()
            results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
        for what, got, want in zip(("out", "dq", "dk", "dv"), *results):
            err = ((got - want).norm() / want.norm()).item()
            assert err <= tol, (name, what, err)


def _flash_varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size,
                            enable_gqa):
    """FlashAttention's documented varlen contract, one sequence at a time: tokens [T, heads, d],
    sequence i = rows cu[i]:cu[i+1]; query i sees key j when i - left <= j <= i + right (a
    negative bound: unbounded)."""
    left, right = window_size
    outs = []
    for i in range(cu_q.numel() - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi = (t[r].transpose(0, 1)[None] for t, r in ((q, qs), (k, ks), (v, ks)))
        d = torch.arange(ki.shape[2])[None, :] - torch.arange(qi.shape[2])[:, None]
        seen = torch.ones_like(d, dtype=torch.bool)
        if right >= 0:
            seen &= d <= right
        if left >= 0:
            seen &= d >= -left
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=seen, scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(outs)


def test_varlen_path_flattens_documents_and_windows(monkeypatch):
    """The CUDA varlen path's own work (documents -> cumulative lengths, window -> FlashAttention's
    window_size, the [tokens, heads, d] layout), run on the CPU through FlashAttention's
    documented contract in place of the GPU kernel, against the dense reference."""
    import torch.nn.attention.varlen as varlen
    import megazoo.parallel.kernels.attention as kernels
    monkeypatch.setattr(varlen, "varlen_attn", _flash_varlen_semantics)
    monkeypatch.setattr(kernels, "choose_attention",
                        lambda *a, **kw: AttentionChoice("varlen", "flash_varlen"))
    g = torch.Generator().manual_seed(0)
    ids = _packed_ids([[5, 20, 15], [1, 39]])
    q = torch.randn(2, 4, 40, 8, generator=g)
    k, v = (torch.randn(2, 2, 40, 8, generator=g) for _ in range(2))
    for kw in (dict(q_document_ids=ids), dict(window=6), dict(q_document_ids=ids, window=6),
               dict(causal=False, q_document_ids=ids)):
        got = attention(q, k, v, **kw)
        want = reference_attention(q, k, v, causal=kw.get("causal", True), q_ids=kw.get(
            "q_document_ids"), window=kw.get("window"))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(kw))


def test_per_document_attention_does_only_the_documents_work(monkeypatch):
    """Packed documents on the CPU: one kernel call per document, each over that document's
    keys only (block diagonal), no [s, s] mask: on the generic path (here non-causal) and on
    the causal flash path, forward and backward."""
    import megazoo.parallel.kernels.attention as kernels
    import megazoo.parallel.kernels.cpu_documents as cpu_documents
    shapes = []
    real = kernels.run_dense

    def counting(kernel, q, k, v, mask, *args):
        shapes.append((q.shape[2], k.shape[2], None if mask is None else tuple(mask.shape)))
        return real(kernel, q, k, v, mask, *args)
    monkeypatch.setattr(kernels, "run_dense", counting)
    ids = _packed_ids([[100, 300, 112], [512]])
    q = torch.randn(2, 2, 512, 8)
    attention(q, q, q, q_document_ids=ids, causal=False)
    documents = [(100, 100, None), (300, 300, None), (112, 112, None), (512, 512, None)]
    assert shapes == documents
    shapes.clear()
    for name in ("flash_forward", "flash_backward"):
        def counted(*args, real=getattr(cpu_documents, name), name=name):
            q, k = args[1:3] if name == "flash_backward" else args[:2]
            shapes.append((name, q.shape[2], k.shape[2]))
            return real(*args)
        monkeypatch.setattr(cpu_documents, name, counted)
    x = q.clone().requires_grad_()
    attention(x, x, x, q_document_ids=ids).sum().backward()
    assert shapes == [(name, m, n) for name in ("flash_forward", "flash_backward")
                      for m, n, _ in documents]
    shapes.clear()
    shapes.clear()
    attention(q, q, q, window=128)  # blocks of 128 queries over at most 255 keys
    assert len(shapes) == 4 and max(n for _, n, _ in shapes) == 255


# ---- the CPU bf16/fp16 pass-precision split (moved from tests/test_attention.py) -------------

def _saved_bytes(fn) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


@pytest.mark.parametrize("dtype,fp32_backward_keys", [(BF16, 512), (BF16, 0), (FP16, 512)])
def test_low_precision_attention_saves_what_sdpa_saves(dtype, fp32_backward_keys, monkeypatch):
    """Whichever precision bf16's backward takes (48 keys: 512 takes the fp32 backward, 0 the
    bf16 one), autograd saves the same bytes as SDPA's own low-precision kernel."""
    monkeypatch.setattr(cpu_attention, "CPU_BF16_FP32_BACKWARD_MAX_KEYS", fp32_backward_keys)
    g = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.5, 0.25, 0.125, 0.0625])
    for alibi, q_len in ((False, 48), (True, 48), (False, 16)):
        s = slopes if alibi else None
        q0 = torch.randn(2, 8, q_len, 16, generator=g).to(dtype)
        k0, v0 = (torch.randn(2, 2, 48, 16, generator=g).to(dtype) for _ in range(2))
        r = torch.randn(2, 8, q_len, 16, generator=g)
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
        (attention(q, k, v, alibi_slopes=s, q_offset=48 - q_len).float() * r).sum().backward()
        want = reference_attention(q0, k0, v0, slopes=s, q_offset=48 - q_len)
        out = attention(q0, k0, v0, alibi_slopes=s, q_offset=48 - q_len).float()
        assert (out - want).norm() <= 1e-2 * want.norm()

        def native():
            from megazoo.parallel.kernels.attention import position_bias
            mask = None if s is None and q_len == 48 else position_bias(
                48 - q_len, q_len, 0, 48, causal=True, window=None, slopes=s, dtype=dtype,
                device=CPU)[None]
            q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True).sum().backward()

        def ours():
            q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
            attention(q, k, v, alibi_slopes=s, q_offset=48 - q_len).sum().backward()
        assert _saved_bytes(ours) == _saved_bytes(native)


def test_bf16_attention_runs_under_any_cpu_capability():
    """Under ATEN_CPU_CAPABILITY=avx2 on an AMX machine, SDPA's own bf16 CPU kernel fails
    ("pack_vnni2 is only supported when avx512 is supported") from 64 tokens on; there the
    passes run in fp32. Run the suite with that setting too (DEVELOPING.md)."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 64, 16, generator=g).to(BF16) for _ in range(3))
    results = []
    for compute in (BF16, FP32):
        q, k, v = (t.detach().to(compute).requires_grad_() for t in (q0, k0, v0))
        attention(q, k, v).float().square().sum().backward()
        results.append([q.grad.float(), k.grad.float(), v.grad.float()])
    for got, want in zip(*results):
        assert (got - want).norm() <= 1e-2 * want.norm(), ((got - want).norm() / want.norm()).item()


def test_lm_head_loss_chunk_by_device_and_dtype():
    from megazoo.parallel.kernels.lm_head_loss import (CHUNK_TOKENS, CPU_LOW_PRECISION_CHUNK_TOKENS,
                                               chunk_tokens)
    assert chunk_tokens(CPU, BF16) == chunk_tokens(CPU, FP16) == CPU_LOW_PRECISION_CHUNK_TOKENS
    assert chunk_tokens(CPU, FP32) == chunk_tokens(CUDA, BF16) == chunk_tokens(CUDA, FP32) \
        == CHUNK_TOKENS


# ---- ring attention blocks -----------------------------------------------------------------------

def test_ring_block_dispatch_and_exchange_dtype():
    from megazoo.parallel.kernels.attention_block import choose_block_kernel as c, ring_compute_dtype
    assert c(CPU, BF16, bias=False) == c(CPU, FP32, bias=True) == "cpu_flash"
    assert c(CUDA, BF16, bias=False, capability=H100) == c(CUDA, FP16, bias=False,
                                                           capability=A100) == "cuda_flash"
    assert c(CUDA, BF16, bias=True, capability=H100) == c(CUDA, FP32, bias=False,
                                                          capability=H100) == "matmul"
    assert c(CUDA, BF16, bias=False, capability=V100) == "matmul"
    # K/V travel in fp32 on the CPU (its measured path), in the activation dtype on a GPU
    assert ring_compute_dtype(CPU, BF16) == FP32
    assert ring_compute_dtype(CUDA, BF16) == BF16 and ring_compute_dtype(CUDA, FP32) == FP32


@pytest.mark.parametrize("alibi", [False, True])
def test_ring_attention_in_the_activation_dtype(alibi, monkeypatch):
    """The GPU's ring path on the CPU (K/V in bf16, blocks on the matmul fallback that CUDA
    takes for ALiBi), one rank: output and gradients against the dense reference."""
    from megazoo.parallel import collectives as C
    from megazoo.parallel import ring_attention as ra
    monkeypatch.setattr(ra, "ring_compute_dtype", lambda device, dtype: dtype)
    monkeypatch.setattr(ra, "_fused", lambda device: False)
    seen = []
    real = ra.block_forward
    monkeypatch.setattr(ra, "block_forward", lambda q, k, *a: seen.append(k.dtype) or real(q, k, *a))
    g = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    q0 = torch.randn(2, 4, 16, 8, generator=g).to(BF16)
    k0, v0 = (torch.randn(2, 2, 16, 8, generator=g).to(BF16) for _ in range(2))
    r = torch.randn(2, 4, 16, 8, generator=g)
    results = []
    for ring in (True, False):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
        out = ra.ring_attention(q, k, v, C.SINGLE, slopes) if ring else \
            reference_attention(q, k, v, slopes=slopes)
        (out.float() * r).sum().backward()
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    assert seen == [BF16]
    for got, want in zip(*results):
        assert (got - want).norm() <= 1e-2 * want.norm(), ((got - want).norm() / want.norm()).item()


def _flash_contract_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *,
                            scale=None):
    """FlashAttention-2's varlen forward contract: out [T, heads, d], lse [heads, T]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for i in range(cu_q.numel() - 1):
        qi, ki, vi = (t[c[i]:c[i + 1]].transpose(0, 1)
                      for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        s = qi @ ki.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        lse = s.logsumexp(-1)
        outs.append((torch.softmax(s, -1) @ vi).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1), None, None, None


def _flash_contract_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                             rng_state, unused, *, scale=None):
    """Its backward from the final output and lse: dq, dk, dv [T, heads, d]."""
    grads = []
    for i in range(cu_q.numel() - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi, doi, oi = (t[r].transpose(0, 1) for t, r in
                               ((q, rq), (k, rk), (v, rk), (do, rq), (out, rq)))
        s = qi @ ki.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - lse[:, rq, None])
        ds = p * (doi @ vi.transpose(-1, -2) - (doi * oi).sum(-1, keepdim=True))
        grads.append([(ds @ ki * scale).transpose(0, 1), (ds.transpose(-1, -2) @ qi * scale)
                      .transpose(0, 1), (p.transpose(-1, -2) @ doi).transpose(0, 1)])
    return tuple(torch.cat(parts) for parts in zip(*grads))


def test_cuda_ring_block_plumbing_against_flash_contract(monkeypatch):
    """The CUDA ring block's own work (layout to FlashAttention's varlen form and back, its
    log-sum-exp layout both ways, GQA heads expanded and summed), run on the CPU through
    FlashAttention's contract in place of the GPU kernel, against the CPU flash block."""
    import megazoo.parallel.kernels.attention_block as blocks
    from megazoo.parallel import ring_attention as ra
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(2))
    do = torch.randn(q.shape, generator=g)
    results = []
    for kernel in ("cpu_flash", "cuda_flash"):
        with monkeypatch.context() as m:
            m.setattr(torch.ops.aten, "_flash_attention_forward", _flash_contract_forward)
            m.setattr(torch.ops.aten, "_flash_attention_backward", _flash_contract_backward)
            m.setattr(ra, "choose_block_kernel", lambda *a, **kw: kernel)
            blocks._flash_lse_layout.cache_clear()
            for causal in (True, False):
                out, lse = ra.block_forward(q, k, v, 0.3, None, causal)
                results.append([out, lse, *ra.block_backward(q, k, v, do, out, lse, 0.3, None,
                                                             causal)])
            blocks._flash_lse_layout.cache_clear()
    for got, want in zip(results[2:], results[:2]):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
