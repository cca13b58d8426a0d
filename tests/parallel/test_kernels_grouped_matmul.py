"""parallel/kernels/grouped_matmul.py: which MoE expert matmul each (device, dtype) gets, as data
(no GPU needed), and every CPU kernel, alone and in an MoE layer, against a plain fp64 loop over
the experts. The attention, loss and ring kernels: test_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H100, A100 = (9, 0), (8, 0)


def test_grouped_matmul_dispatch_by_device_and_dtype():
    from megazoo.parallel.kernels.grouped_matmul import (ONEDNN_ROW_MULTIPLE, GroupedMatmulChoice as G,
                                                 choose_grouped_matmul as c)
    assert c(CPU, FP32) == G("grouped_mm", 1)
    assert c(CPU, BF16) == c(CPU, FP16) == G("grouped_mm", ONEDNN_ROW_MULTIPLE)
    assert c(CUDA, BF16, capability=H100) == G("grouped_mm", 1)  # no padding on the GPU
    assert c(CUDA, BF16, capability=A100) == c(CUDA, FP32, capability=H100) == \
        c(CUDA, FP16, capability=H100) == G("loop", 1)


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_grouped_matmul_kernels_equal_a_loop_reference(kernel):
    """Forward and both gradients of each kernel, with empty groups and no rows at all, and with
    widths whose rows are not a multiple of 16 bytes (fp32 37 / hidden 90, bf16 36), which
    `torch._grouped_mm` refuses unpadded."""
    from megazoo.parallel.kernels.grouped_matmul import ExpertMatmuls, GroupedMatmulChoice
    g = torch.Generator().manual_seed(0)
    cases = [(FP32, 16, 24, c) for c in ([3, 0, 5, 2], [0, 0, 0, 0], [0, 7, 0, 0])] + \
        [(BF16, 16, 24, [0, 7, 0, 0])] + \
        [(dtype, h, f, [3, 0, 5, 2]) for dtype, h, f in ((FP32, 16, 37), (FP32, 90, 24),
                                                        (BF16, 16, 36), (BF16, 90, 32))]
    for dtype, h, f, counts in cases:
        counts = torch.tensor(counts)
        n = int(counts.sum())
        x0 = torch.randn(n, h, generator=g).to(dtype)
        w0 = torch.randn(4, f, h, generator=g).to(dtype)
        r = torch.randn(n, f, generator=g)
        expert = torch.repeat_interleave(torch.arange(4), counts)
        results = []
        for use_kernel in (True, False):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            if use_kernel:
                mm = ExpertMatmuls(x, counts, GroupedMatmulChoice(kernel, 1))
                y = mm.rows_out(mm.linear(mm.rows_in, w))
            else:
                xd, wd = x.double(), w.double()
                y = torch.cat([xd[expert == e] @ wd[e].t() for e in range(4)])
            # no rows: the gradient of a sum over nothing (strides 0) must pass too
            (y.float() * r).sum().backward() if n else y.sum().backward()
            results.append((y.float(), x.grad.float(), w.grad.float()))
        for what, got, want in zip(("y", "dx", "dw"), *results):
            tol = 1e-5 if dtype == FP32 else 1e-2
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err <= tol, (dtype, h, f, counts.tolist(), what, err)


@pytest.mark.parametrize("dtype,hidden,width", [("float32", 32, 37), ("bfloat16", 32, 36),
                                                ("float32", 90, 32)])
def test_moe_layer_trains_with_unaligned_expert_widths(dtype, hidden, width):
    """The shapes that crashed every MoE forward in `torch._grouped_mm` ("strides should be
    multiple of 16 bytes") run forward and backward and match one expert at a time."""
    from megazoo.models.config import TransformerConfig
    from megazoo.models.init import Initializer
    from megazoo.models.moe import MoELayer
    from megazoo.parallel.topology import ParallelTopology
    cfg = TransformerConfig(vocab_size=96, hidden_size=hidden, num_layers=1,
                            num_attention_heads=2 if hidden % 4 == 0 else 3,  # head_dim even (RoPE)
                            normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                            bias=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=width,
                            params_dtype=dtype)
    layer = MoELayer(cfg, ParallelTopology.single(), Initializer(cfg), "layers.0.mlp.")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, hidden, generator=g).to(cfg.dtype).requires_grad_()
    counts = torch.tensor([5, 0, 10, 4])
    y = layer.experts(x, counts)
    y.float().square().sum().backward()
    w1, w2 = (p.detach().double() for p in (layer.experts.weight1, layer.experts.weight2))
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = (x.detach().double()[start:start + n] @ w1[e].t()).chunk(2, -1)
        want.append((F.silu(gate) * up) @ w2[e].t())
        start += n
    want = torch.cat(want)
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert ((y.double() - want).norm() / want.norm()).item() <= tol
    assert x.grad.isfinite().all() and layer.experts.weight1.grad.abs().sum() > 0
