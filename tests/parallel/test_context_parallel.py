"""Context parallelism (ring and all-to-all attention) against the unsharded model.

One 4-rank gloo world checks, for GPT (learned positions), BLOOM (ALiBi, embedding norm) and
Llama (RoPE, GQA 8 heads / 4 KV heads, SwiGLU, RMSNorm), under (cp2 x dp2), (cp4), (tp2, cp2,
sequence parallel) and (pp2, cp2; 1F1B), each with --cp-comm-type p2p and a2a, plus interleaved
pp2 x vpp2 x cp2 and full activation recompute (cp4; tp2 x cp2 x SP): the loss and the
gradient of every parameter, averaged over data x context parallel and gathered over TP, equal the
single-process model's on the full batch (fp32, rtol = atol = 1e-5). The batch goes through the
training code: `training.run.batches.microbatches` hands each rank its chunks, `activation_shape` sizes the
pipeline's messages.

A second world trains 3 steps with the ZeRO-2 optimizer (reducing over dp x cp) under cp2 x dp2
(GPT, ring), cp4 (Llama, a2a) and tp2 x cp2 x SP (Llama, ring), and ZeRO-3 under cp2 x dp2 (BLOOM,
a2a): losses and gradient norms equal plain AdamW on one process within rtol = atol = 1e-5, the
final parameters by `tests/tolerances.py::assert_trained_close` (Adam normalises gradient entries
whose fp32 sums the context split reassociates). A checkpoint written under
cp2 x dp2 (ZeRO states sharded over dp x cp) reads back as the same full tensors and moments,
loads exactly into cp4 and cp1 x dp4, and the next step there equals the next step under cp2.

The third world measures the activation bytes one transformer layer saves for backward (the
pipeline engine's counter) at sequence 8192 under C = 1, 2, 4: they fall as 1/C within 10%.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.context_split import local_positions, split_sequence
from megazoo.parallel.layout import LayoutError, ParallelConfig
from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelTopology
from tests.distributed import all_reduce_each, run_distributed, sum_tied_embedding_grads

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, MICRO = 4, 16, 2
MODELS = {
    "gpt": dict(num_attention_heads=4),
    "bloom": dict(num_attention_heads=4, position_embedding="alibi", embedding_layernorm=True),
    "llama": dict(hidden_size=64, num_attention_heads=8, num_query_groups=4, position_embedding="rope",
                  normalization="rmsnorm", activation="swiglu", bias=False, tie_word_embeddings=False),
}
LAYOUTS = [dict(cp=2), dict(cp=4), dict(tp=2, cp=2, sequence_parallel=True), dict(pp=2, cp=2)]
# (model, layout, comm, config changes): interleaved pipelining, full activation recompute
EXTRA = [("llama", dict(pp=2, vpp=2, cp=2), "p2p", dict(num_layers=4)),
         ("bloom", dict(pp=2, vpp=2, cp=2), "a2a", dict(num_layers=4)),
         ("gpt", dict(cp=4), "p2p", dict(recompute_granularity="full")),
         ("llama", dict(tp=2, cp=2, sequence_parallel=True), "a2a",
          dict(recompute_granularity="selective"))]


def config(kind: str, **kw) -> TransformerConfig:
    base = dict(vocab_size=101, hidden_size=48, num_layers=2, ffn_hidden_size=96,
                max_position_embeddings=SEQ, make_vocab_size_divisible_by=8, seed=7)
    return TransformerConfig(**{**base, **MODELS[kind], **kw})


class _Tokens:
    """A dataset of fixed random samples (SEQ + 1 tokens each) for training.run.batches.microbatches."""

    def __init__(self, n: int, seed: int):
        self.t = torch.randint(0, 101, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return {"tokens": self.t[i].numpy()}


def _dp_cp_mean(tensors, topo) -> None:
    tensors = list(tensors)
    all_reduce_each(tensors, topo.dp_cp_group)
    for t in tensors:
        t /= topo.dp * topo.cp


def _numerics_worker(rank):
    from megazoo.training.run.batches import microbatches
    from megazoo.training.run.step import activation_shape
    torch.use_deterministic_algorithms(True)
    data = _Tokens(BATCH, seed=3)
    ids, labels = data.t[:, :-1], data.t[:, 1:]
    worst, checked = {"loss": 0.0, "grad": 0.0}, []
    cases = [(kind, layout, comm, {}) for kind in MODELS for layout in LAYOUTS
             for comm in ("p2p", "a2a")] + EXTRA
    refs = {}
    for kind, layout, comm, changes in cases:
        cfg = config(kind, **changes)
        key = (kind, cfg.num_layers)
        if key not in refs:
            ref = TransformerLanguageModel(cfg, ParallelTopology.single())
            ref_loss = ref(ids, labels=labels).mean()
            ref_loss.backward()
            single = ParallelTopology.single()
            refs[key] = ref_loss.detach(), {n: full_tensor(p, single, p.grad)
                                            for n, p in ref.named_parameters()}
        ref_loss, ref_grads = refs[key]
        where = f"{kind} {layout} {comm} {changes}"
        topo = ParallelTopology.from_config(ParallelConfig(**layout, cp_comm_type=comm))
        chunks = [TransformerLanguageModel(cfg, topo, **spec.kwargs())
                  for spec in partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]]
        broadcast_tied_embedding(chunks, topo)
        it = microbatches(data, consumed_samples=0, micro_batch_size=BATCH // topo.dp // MICRO,
                          dp_rank=topo.dp_rank, dp=topo.dp, device=topo.device,
                          cp=topo.cp, cp_rank=topo.cp_rank)
        mbs = [next(it) for _ in range(MICRO)]
        assert mbs[0]["tokens"].shape[1] == SEQ // topo.cp, where

        def forward_fn(chunk, x, mb):
            if not chunk.post_process:
                return chunk(mb["tokens"] if chunk.pre_process else x)
            return chunk(mb["tokens"] if chunk.pre_process else x, labels=mb["labels"]).mean()

        name = "no_pipelining" if topo.pp == 1 else "interleaved" if topo.vpp > 1 else "1f1b"
        schedule = build_schedule(name, topo.pp, topo.pp_rank, MICRO, topo.vpp)
        shape = activation_shape(topo, SEQ, BATCH // topo.dp // MICRO, cfg.hidden_size)
        losses = run_pipeline(schedule, chunks, mbs, topo, shape, torch.float32, forward_fn)
        sum_tied_embedding_grads(chunks, topo)
        params = [(c.canonical_name(n), p) for c in chunks for n, p in c.named_parameters()]
        extra = [torch.stack(losses).mean()] if losses else []
        _dp_cp_mean([p.grad for _, p in params] + extra, topo)
        if extra:
            torch.testing.assert_close(extra[0], ref_loss, **TOL, msg=where)
            worst["loss"] = max(worst["loss"], (extra[0] - ref_loss).abs().item())
        for pname, p in params:
            g = full_tensor(p, topo, p.grad)
            torch.testing.assert_close(g, ref_grads[pname], **TOL,
                                       msg=lambda m: f"{where} grad {pname}: {m}")
            worst["grad"] = max(worst["grad"], (g - ref_grads[pname]).abs().max().item())
        checked.append(where)
    return worst, checked


def test_loss_and_gradients_equal_the_unsharded_model():
    out = run_distributed(_numerics_worker, 4, timeout=600)
    worst, checked = out[0]
    assert len(checked) == len(MODELS) * len(LAYOUTS) * 2 + len(EXTRA)
    print("context parallel numerics, worst |error|:", worst)


def _train_step(model, opt, topo, step: int) -> tuple[float, float]:
    """One ZeRO step on this rank's share of the ZeRO tests' batch `step`: (loss, grad norm)."""
    from tests.helpers import batch
    ids, labels = (split_sequence(t.chunk(topo.dp)[topo.dp_rank], 1, topo.cp, topo.cp_rank)
                   for t in batch(step))
    loss = model(ids, labels=labels).float().mean()
    opt.backward(loss)
    norm = opt.step().grad_norm
    opt.zero_grad()
    t = loss.detach().double().reshape(1)
    _dp_cp_mean([t], topo)
    return t.item(), norm


def _training_worker(rank, tmp):
    from megazoo.parallel.zero import build_optimizer
    from tests.helpers import (HYPER, STEPS, full_model_parameters, initial_parameters,
                               opt_config, reference_run, small_gpt)
    from tests.tolerances import assert_trained_close
    torch.use_deterministic_algorithms(True)
    cases = [("gpt", dict(cp=2), "p2p", 2), ("llama", dict(cp=4), "a2a", 2),
             ("llama", dict(tp=2, cp=2, sequence_parallel=True), "p2p", 2),
             ("bloom", dict(cp=2), "a2a", 3)]
    worst = {}
    for kind, layout, comm, zero in cases:
        where = f"zero{zero} {kind} {layout} {comm}"
        cfg = small_gpt(**MODELS[kind])
        ref_losses, ref_params, ref_norms = reference_run(ParallelTopology.single(), cfg)
        topo = ParallelTopology.from_config(ParallelConfig(**layout, cp_comm_type=comm))
        model = TransformerLanguageModel(cfg, topo)
        opt = build_optimizer(model, topo, opt_config(zero_stage=zero))
        losses, norms = zip(*(_train_step(model, opt, topo, step) for step in range(STEPS)))
        torch.testing.assert_close(list(losses), ref_losses, **TOL, msg=where)
        torch.testing.assert_close(list(norms), ref_norms, **TOL, msg=where)
        params = full_model_parameters(model, opt, topo)
        assert_trained_close(params, ref_params, initial_parameters(cfg), where, HYPER["lr"])
        worst[where] = max(((params[n] - ref_params[n]).abs().max().item(), n) for n in params)
        if layout == dict(cp=2) and zero == 2:
            _checkpoint_moves_between_c(model, opt, topo, cfg, params, tmp)
    return worst


def _checkpoint_moves_between_c(model, opt, topo, cfg, params, tmp) -> None:
    """Save under cp2 x dp2 with ZeRO-2 (states sharded over dp x cp): the reader sees the cp
    ranks as replicas and rebuilds every full tensor, which loads exactly into cp4 and cp1 x dp4."""
    from megazoo.parallel.random import RNGStreams
    from megazoo.parallel.zero import build_optimizer
    from tests.helpers import HYPER, STEPS, full_model_parameters, opt_config
    from tests.tolerances import assert_trained_close
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint import reshard
    from megazoo.training.checkpoint.save import rank_tensors
    tensors = rank_tensors([model], opt, RNGStreams(), 2)
    layout = dict(tp=1, pp=1, dp=topo.dp, vpp=1, world_size=topo.world_size, zero_stage=2, cp=2)
    folder = ckpt.save_checkpoint(tmp, 3, topo.rank, topo.world_size, tensors, dict(layout=layout))
    full = reshard.read_full_state(folder)
    for name, t in params.items():
        torch.testing.assert_close(full.master[name], t, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(full.weights[name], t, rtol=0, atol=0, msg=name)
    moments = {k: v for k, v in full.optim.items() if k != "master"}
    assert set(moments) >= {"exp_avg", "exp_avg_sq"}
    states = {}
    for cp in (4, 1):
        there = ParallelTopology.from_config(ParallelConfig(cp=cp))
        model2 = TransformerLanguageModel(cfg, there)
        opt2 = build_optimizer(model2, there, opt_config(zero_stage=2))
        reshard.load_into(full, [model2], opt2, there, weights_only=False, folder=folder)
        for name, t in full_model_parameters(model2, opt2, there).items():
            torch.testing.assert_close(t, params[name], rtol=0, atol=0, msg=f"cp{cp} {name}")
        assert (opt2.iteration, opt2.applied_steps) == (opt.iteration, opt.applied_steps)
        states[cp] = (model2, opt2, there)
    # the moments came along too: one more step from the loaded states matches the original's
    states[2] = (model, opt, topo)
    after = {}
    for cp, (m, o, t) in states.items():
        _train_step(m, o, t, STEPS)
        after[cp] = full_model_parameters(m, o, t)
    for cp in (4, 1):
        assert_trained_close(after[cp], after[2], params, f"step after loading cp2 into cp{cp}",
                             HYPER["lr"])


def test_zero_training_and_checkpoint_under_context_parallelism(tmp_path):
    out = run_distributed(_training_worker, 4, str(tmp_path), timeout=600)
    print("ZeRO x CP: worst parameter error after 3 steps", out[0])


def _memory_worker(rank, seq):
    saved = {}
    cfg = TransformerConfig(vocab_size=101, hidden_size=64, num_layers=1, num_attention_heads=4,
                            ffn_hidden_size=128, position_embedding="rope", seed=7)
    for cp in (1, 2, 4):
        topo = ParallelTopology.from_config(ParallelConfig(cp=cp))
        layer = TransformerLanguageModel(cfg, topo, pre_process=False, post_process=False)
        x = torch.randn(seq // cp, 1, cfg.hidden_size)
        stats = PipelineStats()
        run_pipeline(build_schedule("no_pipelining", 1, 0, 1), [layer], [{"x": x}], topo,
                     x.shape, torch.float32, lambda chunk, _, mb: chunk(mb["x"]).sum(), stats=stats)
        saved[cp] = stats.saved_bytes[(0, 0)]
    return saved


def test_saved_activation_bytes_fall_as_one_over_c():
    saved = run_distributed(_memory_worker, 4, 8192, timeout=600)
    for rank, by_c in enumerate(saved):
        for cp in (2, 4):
            ratio = by_c[cp] / by_c[1]
            assert abs(ratio * cp - 1) <= 0.10, (rank, cp, ratio, by_c)
    print("saved bytes per rank for one layer at seq 8192:", saved[0])


def test_chunks_positions_and_refusals():
    # chunks i and 2C-1-i: every position exactly once over the ranks; the data split agrees
    for cp in (1, 2, 4):
        allpos = torch.cat([local_positions(SEQ // cp, cp, r) for r in range(cp)])
        assert sorted(allpos.tolist()) == list(range(SEQ))
        x = torch.arange(3 * SEQ).reshape(3, SEQ)
        for r in range(cp):
            assert torch.equal(split_sequence(x, 1, cp, r), x[:, local_positions(SEQ // cp, cp, r)])
    assert local_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(4, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(LayoutError, match="divisible by 4"):
        ParallelConfig(cp=2).check_model(num_layers=2, num_attention_heads=4, seq_length=18)
    with pytest.raises(LayoutError, match="--cp-comm-type a2a needs"):
        ParallelConfig(cp=4, cp_comm_type="a2a").check_model(num_layers=2, num_attention_heads=8,
                                                              num_query_groups=2)
    with pytest.raises(LayoutError, match="--cp-comm-type a2a needs"):  # MQA: 1 KV head per rank
        ParallelConfig(tp=2, cp=2, cp_comm_type="a2a").check_model(num_layers=2, num_attention_heads=8,
                                                                   num_query_groups=1)
    ParallelConfig(tp=2, cp=2, cp_comm_type="a2a").check_model(num_layers=2, num_attention_heads=8,
                                                               num_query_groups=4)
    with pytest.raises(LayoutError, match="--cp-comm-type 'ring'"):
        ParallelConfig(cp=2, cp_comm_type="ring").validate(4)
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
             "--train-iters", "1", "--mock-data", "--context-parallel-size", "2"]
    run = to_run_config(build_parser().parse_args(flags + ["--cp-comm-type", "a2a"]), world_size=4)
    assert (run.parallel.cp, run.parallel.cp_comm_type) == (2, "a2a")
    with pytest.raises(ArgumentError, match="--attention-dropout 0.1 is not supported"):
        to_run_config(build_parser().parse_args(flags + ["--attention-dropout", "0.1"]), world_size=4)
    with pytest.raises(ArgumentError, match="not divisible by .* --context-parallel-size 2"):
        to_run_config(build_parser().parse_args(flags), world_size=3)


def test_planner_models_context_parallelism():
    from megazoo.models.presets import preset
    from megazoo.training.planning.planner import Cluster, Layout, PlanError, check_layout, memory_per_gpu, step_time
    cfg = preset("llama3-8b")
    base = dict(tp=8, sequence_parallel=True, recompute_granularity="full", zero_stage=1,
                seq_length=131072, flash_attention=True)
    mem = {c: memory_per_gpu(cfg, Layout.of(cp=c, **base)) for c in (1, 2, 4)}
    for c in (2, 4):
        assert mem[c].activations == pytest.approx(mem[1].activations / c, rel=1e-9)
    # ZeRO shards over dp x cp: cp4 x dp1 holds what cp1 x dp4 holds
    assert mem[4].optimizer == pytest.approx(
        memory_per_gpu(cfg, Layout.of(dp=4, **{**base, "seq_length": 32768})).optimizer)
    cluster = Cluster(name="t", num_gpus=32, gpus_per_node=8, peak_flops=989e12,
                      memory_bytes=80e9, intra_node_bw=450e9, inter_node_bw=50e9, hbm_bw=3.35e12)
    t1, t4 = (step_time(cfg, Layout.of(cp=c, dp=4 // c, global_batch_size=4, **base), cluster)
              for c in (1, 4))
    assert t1.cp_comm == 0 and t4.cp_comm >= 0 and t4.compute == pytest.approx(t1.compute)
    check_layout(cfg, Layout.of(cp=4, global_batch_size=1, **base), cluster.replace(num_gpus=32))
    with pytest.raises(PlanError, match="tp\\*pp\\*dp\\*cp = 16"):
        check_layout(cfg, Layout.of(cp=2, global_batch_size=1, **base), cluster)


@pytest.mark.parametrize("fused", [True, False])
def test_ring_block_kernels_match_sdpa(fused, monkeypatch):
    """A ring step's block forward/backward (aten's CPU flash kernel, or the matmul path other
    devices take) equals SDPA and its autograd on one block: GQA, ALiBi bias, causal or not."""
    import math
    import torch.nn.functional as F
    from megazoo.parallel import ring_attention as ra
    monkeypatch.setattr(ra, "_fused", lambda device: fused)
    g = torch.Generator().manual_seed(0)
    b, heads, groups, m, d = 2, 4, 2, 6, 8
    for causal in (True, False):
        for alibi in (False, True):
            q = torch.randn(b, heads, m, d, generator=g, requires_grad=True)
            k, v = (torch.randn(b, groups, m, d, generator=g, requires_grad=True) for _ in range(2))
            bias = torch.randn(heads, m, m, generator=g) if alibi else None
            mask = ra._causal(bias if bias is not None else torch.zeros(1, m, m)) if causal else bias
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            do = torch.randn(ref.shape, generator=g)
            ref.backward(do)
            scale = 1 / math.sqrt(d)
            with torch.no_grad():
                out, lse = ra.block_forward(q, k, v, scale, bias, causal)
                grads = ra.block_backward(q, k, v, do, out, lse, scale, bias, causal)
            torch.testing.assert_close(out, ref.detach(), **TOL)
            for got, t in zip(grads, (q, k, v)):
                torch.testing.assert_close(got, t.grad, **TOL, msg=f"causal={causal} alibi={alibi}")
