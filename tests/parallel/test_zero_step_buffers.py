"""The ZeRO step's buffers: gloo's in-place reduction verbs, the transient-bucket pool, lazily
zeroed gradient shards.

One 2-rank world runs every check: `reduce_scatter_consuming` (in place, or with an output one
exchange between the two gloo ranks) and `all_gather_in_place` give the fused verbs' bytes
exactly; ZeRO-2 and 3 (many small buckets, so that reductions overlap backward and the pool
serves buckets of several sizes; two micro-batches, so that a shard is first copied into, then
added to) end bit for bit where the same runs through the fused verbs
(the branch NCCL takes, reducing straight into a fresh shard) and freshly allocated buckets
end; the pool allocates in the first step only; a step after zero_grad without any backward
sees zero gradients. (Parity with the unsharded reference is test_zero.py's.)
"""
from __future__ import annotations

import torch

from megazoo.parallel import collectives as C
from megazoo.parallel.zero.scratch import ScratchPool
from tests.distributed import run_distributed
from tests.helpers import opt_config, small_gpt, topology, zero_run


def _verbs(rank, out):
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2 * 777, generator=g).to(dtype)
        want = torch.empty(777, dtype=dtype)
        C.reduce_scatter_into(want, x.clone(), None).wait()
        inp = x.clone()
        pending, chunk = C.reduce_scatter_consuming(inp, None)
        pending.wait()
        assert torch.equal(chunk, want), dtype
        assert chunk.data_ptr() == inp[rank * 777:].data_ptr()  # no output: in place, no buffer
        shard = torch.full((777,), float("nan"), dtype=dtype)
        pending, chunk = C.reduce_scatter_consuming(x.clone(), None, out=shard)
        pending.wait()
        assert chunk is shard and torch.equal(shard, want), dtype  # two ranks: straight into out
        same, chunk = C.reduce_scatter_consuming(x, C.SINGLE)
        same.wait()
        assert chunk is x

        mine = x[:777].clone()
        want = torch.empty(2 * 777, dtype=dtype)
        C.all_gather_into(want, mine, None).wait()
        buf = torch.full((2 * 777,), float("nan"), dtype=dtype)
        buf[rank * 777:(rank + 1) * 777] = mine
        C.all_gather_in_place(buf, None).wait()
        assert torch.equal(buf, want), dtype
    out["verbs"] = "ok"


def _pool_unit(out):
    pool = ScratchPool(100, torch.float32, torch.device("cpu"))
    a, b = pool.take(100), pool.take(60)
    assert a.numel() == b.numel() == 100 and pool.created == 2  # one width: any fits any
    narrow = pool.take(49)  # under half the width: not pooled
    assert narrow.numel() == 49 and pool.created == 2
    for t in (a, b, narrow):
        pool.give(t)
    assert pool.held_bytes() == 2 * 100 * 4
    assert {pool.take(70).data_ptr(), pool.take(100).data_ptr()} == {a.data_ptr(), b.data_ptr()}
    assert pool.created == 2
    out["pool"] = "ok"


def _fused_fresh_run(topo, cfg, ocfg):
    """The same run through the fused verbs (NCCL's branch) and freshly allocated buckets."""
    on_host, take = C._on_host, ScratchPool.take
    C._on_host = lambda group: False
    ScratchPool.take = lambda self, numel: torch.empty(numel, dtype=self.dtype, device=self.device)
    try:
        return zero_run(topo, cfg, ocfg, steps=3, microbatches=2)
    finally:
        C._on_host, ScratchPool.take = on_host, take


def _stages(topo, out):
    cfg = small_gpt()
    pools = {}
    for stage in (2, 3):
        ocfg = opt_config(zero_stage=stage, bucket_numel=3000)
        created = []

        def record(step, model, opt):
            created.append(opt.scratch.created)
        losses, params, _, opt = zero_run(topo, cfg, ocfg, steps=3, microbatches=2,
                                          on_step=record)
        want_losses, want, _, _ = _fused_fresh_run(topo, cfg, ocfg)
        assert losses == want_losses, (stage, losses, want_losses)
        for name, p in want.items():
            assert torch.equal(params[name], p), (stage, name)

        pool = opt.scratch
        held = opt.memory_report()["grad_scratch"]
        assert pool.numel == max(b.padded for b in opt.buffers)
        assert held == pool.created * pool.numel * 4 > 0, (held, pool.created)
        # never more than the in-flight reductions plus the buckets being filled (one per key)
        assert pool.created <= opt.cfg.max_inflight_buckets + 2, pool.created
        assert created[0] == created[-1], created  # allocated in the first step, then reused
        pools[stage] = (len(opt.buffers), pool.created, held)

        # zero_grad, then a step without backward: the lazily zeroed shards read as zeros
        opt.zero_grad()
        assert opt.step().grad_norm == 0.0
        assert all(not b.grad_shard.any() for b in opt.buffers)
    out["stages"] = pools


def _worker(rank):
    topo = topology()
    out = {}
    _verbs(rank, out)
    _pool_unit(out)
    _stages(topo, out)
    return out


def test_zero_step_buffers_dp2():
    out = run_distributed(_worker, 2, timeout=180)[0]
    assert set(out) == {"verbs", "pool", "stages"}, out
    print(out)
