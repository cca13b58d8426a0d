"""Causal attention in bf16/fp16 on the CPU runs each pass of SDPA's fused kernel in the faster
precision (`models.attention._CpuLowPrecisionAttention`): outputs and gradients equal fp32
arithmetic on the same low-precision inputs to within the output's rounding, whichever precision
the backward takes, and autograd saves the same bytes as the low-precision kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.attention
from models.attention import alibi_slopes, causal_attention, causal_bias


def _saved_bytes(fn) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


@pytest.mark.parametrize("dtype,fp32_backward_keys", [(torch.bfloat16, 512), (torch.bfloat16, 0),
                                                      (torch.float16, 512)])
@pytest.mark.parametrize("alibi,q_len", [(False, 48), (True, 48), (False, 16)])
def test_low_precision_attention_on_the_cpu(dtype, fp32_backward_keys, alibi, q_len, monkeypatch):
    # 48 keys: 512 takes bf16's fp32 backward, 0 its bf16 backward (the long-sequence case)
    monkeypatch.setattr(models.attention, "CPU_BF16_FP32_BACKWARD_MAX_KEYS", fp32_backward_keys)
    g = torch.Generator().manual_seed(0)
    slopes = alibi_slopes(8) if alibi else None
    q0 = torch.randn(2, 8, q_len, 16, generator=g).to(dtype)
    k0, v0 = (torch.randn(2, 2, 48, 16, generator=g).to(dtype) for _ in range(2))
    r = torch.randn(2, 8, q_len, 16, generator=g)
    results = []
    for compute in (dtype, torch.float32):
        q, k, v = (t.detach().to(compute).requires_grad_() for t in (q0, k0, v0))
        out = causal_attention(q, k, v, slopes)
        assert out.dtype == compute
        (out.float() * r).sum().backward()
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for got, want in zip(*results):  # the output's rounding is ~0.2-0.3% of the norm
        assert (got - want).norm() <= 1e-2 * want.norm(), ((got - want).norm() / want.norm()).item()

    def native():
        mask = None if slopes is None and q_len == 48 else \
            causal_bias(slopes, q_len, 48, dtype, q0.device)[None]
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=True).sum().backward()

    def ours():
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
        causal_attention(q, k, v, slopes).sum().backward()
    assert _saved_bytes(ours) == _saved_bytes(native)


def test_bf16_attention_runs_under_any_cpu_capability():
    """Under ATEN_CPU_CAPABILITY=avx2 on an AMX machine, SDPA's own bf16 CPU kernel fails
    ("pack_vnni2 is only supported when avx512 is supported") from 64 tokens on; there the
    passes run in fp32. Run the suite with that setting too (DEVELOPING.md)."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 64, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    results = []
    for compute in (torch.bfloat16, torch.float32):
        q, k, v = (t.detach().to(compute).requires_grad_() for t in (q0, k0, v0))
        causal_attention(q, k, v).float().square().sum().backward()
        results.append([q.grad.float(), k.grad.float(), v.grad.float()])
    for got, want in zip(*results):
        assert (got - want).norm() <= 1e-2 * want.norm(), ((got - want).norm() / want.norm()).item()
