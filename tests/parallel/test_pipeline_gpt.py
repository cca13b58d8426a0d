"""Pipeline parallelism on the real GPT model, alone and combined with TP, SP and DP.

Every case runs one training step's forward and backward over the same global batch as a
single-process model built from the same seed, and compares the loss and the gradient of every
parameter (gathered over TP; the tied embedding/head pair after its embedding-group sum; the
data-parallel mean taken by the test, as the optimizer would) in fp32 at rtol = atol = 1e-5.
"""
from __future__ import annotations

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import activation_bound, build_schedule
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from tests.distributed import sum_tied_embedding_grads
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed
from tests.helpers import data_parallel_mean, mean_loss_forward, microbatches

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH = 8, 8
CONFIG = dict(vocab_size=101, hidden_size=32, num_layers=8, num_attention_heads=4,
              ffn_hidden_size=64, max_position_embeddings=16, make_vocab_size_divisible_by=8,
              seed=7)


def gpt_batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference():
    single = ParallelTopology.single()
    model = TransformerLanguageModel(TransformerConfig(**CONFIG), single)
    tokens, labels = gpt_batch()
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    return loss.item(), {model.canonical_name(n): full_tensor(p, single, p.grad)
                         for n, p in model.named_parameters()}


def _gpt_worker(rank, cases):
    results = []
    cfg = TransformerConfig(**CONFIG)
    for name, pp, vpp, m, tp, sp, dp_split in cases:
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, vpp=vpp,
                                                           sequence_parallel=sp))
        chunks = [TransformerLanguageModel(cfg, topo, **spec.kwargs())
                  for spec in partition(cfg.num_layers, pp, vpp)[topo.pp_rank]]
        broadcast_tied_embedding(chunks, topo)
        mbs = microbatches(*gpt_batch(), m, topo if dp_split else None)
        shape = (SEQ // tp if topo.sequence_parallel else SEQ, mbs[0]["tokens"].shape[0],
                 cfg.hidden_size)
        stats = PipelineStats()
        losses = run_pipeline(build_schedule(name, pp, topo.pp_rank, m, vpp), chunks, mbs, topo,
                              shape, torch.float32, mean_loss_forward, stats=stats)
        sum_tied_embedding_grads(chunks, topo)
        params = [(c.canonical_name(n), p) for c in chunks for n, p in c.named_parameters()]
        loss = torch.stack(losses).mean() if losses else None
        if dp_split:
            data_parallel_mean([p.grad for _, p in params] + ([loss] if losses else []), topo)
        # numpy, not tensors: torch would pass tensors back through shared memory that dies
        # with the worker process
        grads = {n: full_tensor(p, topo, p.grad).numpy() for n, p in params}
        results.append(dict(loss=None if loss is None else loss.item(), grads=grads,
                            peak=stats.peak_activations,
                            bound=activation_bound(name, pp, topo.pp_rank, m, vpp)))
    return results


def _check(out, cases):
    ref_loss, ref_grads = reference()
    for i, case in enumerate(cases):
        seen = set()
        losses = [r[i]["loss"] for r in out if r[i]["loss"] is not None]
        assert losses, case
        for loss in losses:
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{case}: loss")
        for rank, r in enumerate(out):
            assert r[i]["peak"] <= r[i]["bound"], (case, rank)
            for name, grad in r[i]["grads"].items():
                torch.testing.assert_close(torch.from_numpy(grad), ref_grads[name], **TOL,
                                           msg=lambda msg: f"{case} rank {rank} {name}: {msg}")
                seen.add(name)
        assert seen == set(ref_grads), (case, set(ref_grads) - seen)


# (schedule, pp, vpp, microbatches, tp, sequence_parallel, dp_split). In a 4-rank world pp=2
# leaves dp=2: without dp_split both pipelines run the full batch (a pure pp case).
CASES_4 = [
    ("1f1b", 2, 1, 4, 1, False, False),  # (2,1,4)
    ("interleaved", 2, 2, 4, 1, False, False),  # (2,2,4)
    ("1f1b", 4, 1, 8, 1, False, False),  # (4,1,8)
    ("interleaved", 4, 2, 8, 1, False, False),  # (4,2,8)
    ("1f1b", 2, 1, 4, 1, False, True),  # dp=2 x pp=2
    ("interleaved", 2, 2, 4, 1, False, True),  # dp=2 x pp=2, interleaved
    ("1f1b", 2, 1, 4, 2, False, False),  # tp=2 x pp=2
    ("1f1b", 2, 1, 4, 2, True, False),  # tp=2 x pp=2, sequence parallel
    ("interleaved", 2, 2, 4, 2, True, False),  # tp=2 x pp=2 x vpp=2, sequence parallel
]

CASES_8 = [
    ("1f1b", 4, 1, 4, 1, False, True),  # (4,1,4) x dp=2
    ("interleaved", 4, 2, 4, 1, False, True),  # (4,2,4) x dp=2
    ("1f1b", 4, 1, 8, 2, False, False),  # (4,1,8) x tp=2
    ("interleaved", 4, 2, 8, 2, True, False),  # (4,2,8) x tp=2, sequence parallel
    ("1f1b", 2, 1, 4, 2, True, True),  # tp=2 x pp=2 x dp=2
]


def test_gpt_pipeline_matches_single_process_4_ranks():
    _check(run_distributed(_gpt_worker, 4, CASES_4, timeout=300), CASES_4)


def test_gpt_pipeline_matches_single_process_8_ranks():
    _check(run_distributed(_gpt_worker, 8, CASES_8, timeout=300), CASES_8)
