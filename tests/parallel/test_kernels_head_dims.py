"""Multi-latent attention's values have their own head dim: the bf16/fp16 CPU kernel (one head
dim only) runs them zero-padded and returns the same as SDPA in fp32, forward and backward, with
values narrower or wider than queries and keys (a bf16 DeepSeek-V3 step failed here before)."""
import pytest
import torch
import torch.nn.functional as F

from megazoo.parallel.kernels import cpu_attention
from megazoo.parallel.kernels.attention import attention


@pytest.mark.skipif(not cpu_attention.available(), reason="torch without the CPU flash kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_own_value_head_dim(dtype):
    g = torch.Generator().manual_seed(0)
    for qk_dim, v_dim in ((24, 16), (16, 24)):
        q, k = (torch.randn(2, 4, 32, qk_dim, generator=g, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 4, 32, v_dim, generator=g, requires_grad=True)
        grad = torch.randn(2, 4, 32, v_dim, generator=g)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dq, dk, dv = torch.autograd.grad(want, (q, k, v), grad)
        got = attention(q.to(dtype), k.to(dtype), v.to(dtype))
        assert got.shape == want.shape and got.dtype == dtype
        gq, gk, gv = torch.autograd.grad(got.float(), (q, k, v), grad)
        for a, b in ((got.float(), want), (gq, dq), (gk, dk), (gv, dv)):
            assert (a - b).abs().max() <= 0.05 * b.abs().max(), (qk_dim, v_dim)
