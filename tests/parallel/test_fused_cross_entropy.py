"""The fused LM head + cross-entropy against the unfused head and `F.cross_entropy`.

Single process (tp = 1); the vocabulary-parallel paths (tp 2 and 4, shards of padding only) are
checked through whole models against the tp = 1 model in test_tensor_parallel.py.
"""
import pytest
import torch
import torch.nn.functional as F

import megazoo.parallel.fused_cross_entropy as fused
from megazoo.parallel import collectives as C
import megazoo.parallel.kernels.lm_head_loss as lm_head_loss

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded,chunk", [(0, 1024), (24, 1024), (24, 7)])
@pytest.mark.parametrize("row_softmax,softcap", [(True, None), (False, None), (True, 3.0),
                                                 (False, 3.0)])
def test_matches_unfused(dtype, padded, chunk, row_softmax, softcap, monkeypatch):
    """Both softmax paths (kernels/lm_head_loss.py `row_softmax`: the CPU's bf16 one, and the
    separate passes every other device and dtype takes) in every dtype, with and without a
    final logit softcap (c * tanh(x / c), Gemma's)."""
    monkeypatch.setattr(lm_head_loss, "CHUNK_TOKENS", chunk)  # several chunks, the last one ragged
    monkeypatch.setattr(fused, "row_softmax", lambda device, dtype: row_softmax)
    g = torch.Generator().manual_seed(0)
    vocab, n, h = 1000, 45, 64
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (0.3 * torch.randn(vocab + padded, h, generator=g)).to(dtype)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[3] = -100  # ignored: zero loss, zero gradient
    per_token = torch.rand(n, generator=g)  # a loss mask / mean: any per-token weights

    x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused._LMHeadCrossEntropy.apply(x1, w1, target, C.SINGLE, vocab, True, softcap)
    (loss * per_token).sum().backward()

    x2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = x2 @ w2.t()
    if softcap is not None:
        logits = torch.tanh(logits.float() / softcap) * softcap
    logits = logits.masked_fill(torch.arange(vocab + padded) >= vocab, float("-inf"))
    ref = F.cross_entropy(logits.float(), target, reduction="none", ignore_index=-100)
    (ref * per_token).sum().backward()

    assert loss.dtype == torch.float32 and loss[3] == 0
    torch.testing.assert_close(loss, ref, **TOL[dtype])
    torch.testing.assert_close(x1.grad, x2.grad, **TOL[dtype])
    torch.testing.assert_close(w1.grad, w2.grad, **TOL[dtype])
    assert not w1.grad[vocab:].any()  # padded rows get no gradient


def test_evaluation_computes_the_loss_alone(monkeypatch):
    """Without gradients (evaluation) the loss takes the short path, bitwise the same, and no
    [tokens, vocabulary] gradient is allocated: one chunk's scratch at most."""
    from megazoo.parallel.topology import ParallelTopology
    monkeypatch.setattr(fused, "chunk_tokens", lambda device, dtype: 8)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 1, 16, generator=g).requires_grad_()
    weight = torch.randn(104, 16, generator=g).requires_grad_()  # as a model's parameter
    target = torch.randint(0, 100, (30, 1), generator=g)
    topo = ParallelTopology.single()
    with_grad = fused.lm_head_cross_entropy(hidden, weight, target, topo, 100)
    shapes = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: shapes.append(tuple(a[0]) if a and
                        isinstance(a[0], (tuple, list, torch.Size)) else a) or real_empty(*a, **k))
    with torch.no_grad():
        alone = fused.lm_head_cross_entropy(hidden, weight, target, topo, 100)
    torch.testing.assert_close(alone, with_grad.detach(), rtol=0, atol=0)
    assert shapes and all(s[0] * s[-1] < 30 * 104 for s in shapes if len(s) == 2), shapes


def test_large_host_buffers():
    """The fused loss's large CPU buffers (kernels/host_memory.py) are ordinary tensors of the
    asked shape and dtype whatever the huge-page hint does; small ones skip the hint."""
    from megazoo.parallel.kernels.host_memory import MIN_BYTES, empty_large
    cpu = torch.device("cpu")
    for shape, dtype in (((3, 5), torch.bfloat16), ((MIN_BYTES // 4 + 3, 2), torch.float32)):
        t = empty_large(shape, dtype, cpu)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        t.fill_(1.5)
        assert t.sum().item() == 1.5 * t.numel()
