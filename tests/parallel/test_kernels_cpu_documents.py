"""parallel/kernels/cpu_documents.py: causal attention within packed documents on the CPU's
flash kernel, one autograd node for every document. Output and gradients against a dense fp64
reference (every document's queries over its own earlier keys, written here): fp32 at 1e-5,
bf16 and fp16 at 1e-2 of the norm; grouped heads, a custom scale, documents of 1 token."""
from __future__ import annotations

import pytest
import torch

from megazoo.parallel.kernels.attention import attention, choose_attention

LENGTHS = [[1, 37, 20, 6], [64]]  # two samples of 64 tokens


def reference(q, k, v, ids, scale):
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    pos = torch.arange(q.shape[2])
    seen = (pos[None, :] <= pos[:, None]) & (ids[:, None, :, None] == ids[:, None, None, :])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _grads(fn, q, k, v, r):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out.double() * r).sum().backward()
    return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


@pytest.mark.parametrize("dtype,rel", [(torch.float32, None), (torch.bfloat16, 1e-2),
                                       (torch.float16, 1e-2)])
def test_documents_on_the_cpu_flash_kernel_match_a_dense_reference(dtype, rel):
    assert choose_attention(torch.device("cpu"), dtype, documents=True).path == "cpu_documents"
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                       for row in LENGTHS])
    q = torch.randn(2, 6, 64, 16, generator=g)
    k, v = (torch.randn(2, 2, 64, 16, generator=g) for _ in range(2))
    r = torch.randn(2, 6, 64, 16, generator=g, dtype=torch.float64)
    scale = 0.3
    got = _grads(lambda *t: attention(*t, q_document_ids=ids, scale=scale),
                 *(t.to(dtype) for t in (q, k, v)), r)
    want = _grads(lambda *t: reference(*t, ids, scale), q, k, v, r)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        if rel is None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert (a - b).norm() <= rel * b.norm(), (name, ((a - b).norm() / b.norm()).item())
