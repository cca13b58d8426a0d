"""Ring attention blocks with packed documents (parallel/ring_attention.py `DocumentBlocks`): on
the CPU's fused kernel a block runs as its documents' sub-blocks, with no [m, n] mask. Against the
matmul path with the dense per-sample bias (what other devices run) and SDPA with that mask, on
one block: output, log-sum-exp and gradients at fp32 1e-5; the diagonal step (causal) and an
off-diagonal one whose rows hold a document with no key in the block (zero output, lse -inf)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megazoo.parallel import ring_attention as ra

TOL = dict(rtol=1e-5, atol=1e-5)


def _ids(rows: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[b, n] ids from each sample's (document id, tokens) runs."""
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in row]) for row in rows])


def _block(q, k, v, do, bias, causal, fused, monkeypatch):
    monkeypatch.setattr(ra, "_fused", lambda device: fused)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = ra.block_forward(q, k, v, scale, bias, causal)
    # the backward takes the ring's final lse, finite on every row (each query sees itself)
    final = lse.masked_fill(torch.isinf(lse), 0.0)
    return [out.float(), lse] + [g.float() for g in ra.block_backward(q, k, v, do, out, final,
                                                                      scale, bias, causal)]


def test_document_sub_blocks_equal_the_masked_block(monkeypatch):
    g = torch.Generator().manual_seed(0)
    b, heads, groups, m, d = 2, 4, 2, 12, 8
    cases = [  # (row documents, column documents, causal)
        (_ids([[(0, 5), (1, 7)], [(3, 12)]]),) * 2 + (True,),
        (_ids([[(0, 4), (1, 3), (2, 5)], [(5, 2), (6, 10)]]),
         _ids([[(0, 9), (1, 3)], [(4, 6), (5, 6)]]), False),  # rows of 2 and 6 see no key
    ]
    for q_docs, k_docs, causal in cases:
        monkeypatch.setattr(ra, "_fused", lambda device: True)
        docs = ra.DocumentBlocks(q_docs, k_docs)
        assert docs.pairs is not None and ra._block_kernel(torch.zeros(1), docs) == "cpu_documents"
        q = torch.randn(b, heads, m, d, generator=g, requires_grad=True)
        k, v = (torch.randn(b, groups, m, d, generator=g, requires_grad=True) for _ in range(2))
        do = torch.randn(b, heads, m, d, generator=g)
        with torch.no_grad():
            fused = _block(q, k, v, do, docs, causal, True, monkeypatch)
            matmul = _block(q, k, v, do, docs, causal, False, monkeypatch)
        seen = docs.same & (torch.ones(m, m, dtype=torch.bool).tril() if causal else True)
        hidden = ~seen.any(-1)  # [b, m] rows without a key in the block
        # SDPA: those rows see every key, with no output and no gradient
        mask = torch.zeros(seen.shape).masked_fill(~(seen | hidden[..., None]), float("-inf"))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        ref = ref.masked_fill(hidden[:, None, :, None], 0.0)
        ref.backward(do)
        assert bool(hidden.any()) != causal
        assert torch.isinf(fused[1]).eq(hidden[:, None]).all()
        for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), fused, matmul):
            torch.testing.assert_close(a, c, **TOL, msg=f"causal={causal} {name}")
        want = [ref.detach(), None, q.grad, k.grad, v.grad]
        for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), fused, want):
            if w is not None:
                torch.testing.assert_close(a, w, **TOL, msg=f"causal={causal} {name} vs SDPA")


def test_ids_that_are_not_runs_take_the_masked_block():
    docs = ra.DocumentBlocks(_ids([[(0, 2), (1, 2), (0, 2)]]), _ids([[(0, 6)]]))
    assert docs.pairs is None and ra._block_kernel(torch.zeros(1), docs) == "matmul"
    assert docs.dense().shape == (1, 1, 6, 6)
