"""ZeRO stages 0-3 against plain data parallelism on a small GPT, in gloo worlds.

fp32: losses per step and gradient norms equal the reference within rtol = atol = 1e-5, final
parameters within 1e-3 of how far training moved them (tests/tolerances.py), for dp in {2, 4}, with tp = 2 (stages 0-3) and pp = 2 (stages 0-2). bf16 and fp16 weights stay within
a stated tolerance of the fp32 run. AdamW's eps is 1e-6 in these tests: the attention key bias
has a mathematically zero gradient, so its computed gradient is rounding noise, and with eps
1e-8 Adam turns noise into full-size steps whose sign depends on the summation order.
"""
from __future__ import annotations

import torch

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.pipeline.engine import run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from megazoo.parallel.zero import build_optimizer
from tests.distributed import run_distributed
from tests.helpers import (HYPER, SEQ, STEPS, batch, dp_mean, full_model_parameters,
                           initial_parameters, opt_config, reference_run, small_gpt, topology,
                           zero_run)
from tests.tolerances import assert_trained_close, update_deviation

# Mixed precision against the fp32 ZeRO run of the same stage after STEPS steps: the relative
# loss difference, and the deviation of the weights relative to how far fp32 training moved them,
# ||w - w_fp32|| / ||w_fp32 - w_init|| over all parameters. (A per-element bound is meaningless
# for Adam: an element whose gradient is rounding noise moves by +-lr either way.)
MIXED_TOL = {torch.bfloat16: dict(loss=1e-3, update=0.1), torch.float16: dict(loss=3e-4, update=0.03)}


def _check_parity(topo, cfg, stages, where, microbatches=1):
    ref_losses, ref_params, ref_norms = reference_run(topo, cfg)
    init = initial_parameters(cfg)
    checked = []
    for stage in stages:
        losses, params, results, _ = zero_run(topo, cfg, opt_config(zero_stage=stage),
                                              microbatches=microbatches)
        tag = f"{where} zero={stage} microbatches={microbatches}"
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5, msg=tag)
        torch.testing.assert_close([r.grad_norm for r in results], ref_norms, rtol=1e-5,
                                   atol=1e-5, msg=tag)
        assert not any(r.skipped for r in results), tag
        dev = assert_trained_close(params, ref_params, init, tag, HYPER["lr"])
        checked.append(f"{tag}: parameter deviation {dev:.1e}")
    assert ref_norms[0] > 0.5, "the test should exercise clipping (clip_grad = 0.5)"
    return checked


def _dp_worker(rank, world):
    topo = topology()
    cfg = small_gpt()
    checked = _check_parity(topo, cfg, [0, 1, 2, 3], f"dp={topo.dp}")
    if world == 2:
        # Gradient accumulation: two micro-batches, the first under no_sync (stages 0-1).
        checked += _check_parity(topo, cfg, [0, 1, 2, 3], f"dp={topo.dp}", microbatches=2)
        # ZeRO-3 with activation checkpointing: layers are recomputed inside backward, here
        # both layers as one unit (--recompute-num-layers 2).
        checked += _check_parity(topo, small_gpt(recompute_granularity="full",
                                                 recompute_num_layers=2), [3],
                                 f"dp={topo.dp} recompute")
        return checked
    # Mixed precision against the fp32 run of the same stage.
    init = initial_parameters(cfg)
    for stage, dtype in ((1, torch.float16), (2, torch.bfloat16), (3, torch.bfloat16),
                         (0, torch.bfloat16)):
        f_losses, f_params, _, _ = zero_run(topo, cfg, opt_config(zero_stage=stage))
        losses, params, results, opt = zero_run(topo, cfg, opt_config(zero_stage=stage),
                                                dtype=dtype)
        tol, tag = MIXED_TOL[dtype], f"zero={stage} {dtype}"
        assert not any(r.skipped for r in results), tag
        assert all(p.dtype == dtype for p in opt.modules[0].parameters())
        assert len(losses) == len(f_losses) == STEPS, (tag, losses, f_losses)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, f_losses))
        deviation = update_deviation(params, f_params, init)
        assert loss_diff < tol["loss"] and deviation < tol["update"], (tag, loss_diff, deviation)
        checked.append(f"{tag}: loss rel diff {loss_diff:.1e}, weight deviation {deviation:.1e}")
    return checked


def test_zero_stages_match_data_parallel_dp2():
    results = run_distributed(_dp_worker, 2, 2, timeout=300)
    assert len(results[0]) == 9
    print("\n".join(results[0]))


def test_zero_stages_match_data_parallel_dp4_and_mixed_precision():
    results = run_distributed(_dp_worker, 4, 4, timeout=300)
    assert len(results[0]) == 8
    print("\n".join(results[0]))


def _tp_worker(rank):
    topo = topology(tp=2)
    return _check_parity(topo, small_gpt(), [0, 1, 2, 3], f"tp=2 dp={topo.dp}")


def test_zero_with_tensor_parallel():
    results = run_distributed(_tp_worker, 4, timeout=300)
    assert len(results[0]) == 4
    print("\n".join(results[0]))


def _loss_fn(chunk, inp, mb):
    out = chunk(mb["tokens"] if inp is None else inp,
                labels=mb["labels"] if chunk.post_process else None)
    return out.mean() if chunk.post_process else out


def _pp_worker(rank):
    topo = topology(pp=2)
    cfg = small_gpt()
    ref_losses, ref_params, _ = reference_run(topo, cfg)
    init = initial_parameters(cfg)
    specs = partition(cfg.num_layers, topo.pp, 1)[topo.pp_rank]
    schedule, m = build_schedule("1f1b", topo.pp, topo.pp_rank, 2), 2
    checked = []
    # Stage 1 without no_sync reduces after every micro-batch; with no_sync, once at the step.
    for stage, no_sync in ((0, True), (1, False), (1, True), (2, True)):
        chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs()) for s in specs]
        broadcast_tied_embedding(chunks, topo)
        opt = build_optimizer(chunks, topo, opt_config(zero_stage=stage))
        losses = []
        for step in range(STEPS):
            ids, labels = batch(step, topo)
            mbs = [{"tokens": t, "labels": y} for t, y in zip(ids.chunk(m), labels.chunk(m))]
            shape = (SEQ, mbs[0]["tokens"].shape[0], cfg.hidden_size)
            with opt.no_sync() if no_sync else _nothing():
                out = run_pipeline(schedule, chunks, mbs, topo, shape, torch.float32, _loss_fn)
            result = opt.step()
            opt.zero_grad()
            assert not result.skipped
            if topo.is_last_stage:
                losses.append(dp_mean(torch.stack(out).mean().item(), topo))
        tag = f"pp=2 dp={topo.dp} zero={stage} no_sync={no_sync}"
        if topo.is_last_stage:
            assert len(losses) == STEPS, (tag, losses)
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5, msg=tag)
        dev = max(assert_trained_close(full_model_parameters(chunk, opt, topo), ref_params, init,
                                       tag, HYPER["lr"]) for chunk in chunks)
        checked.append(f"{tag}: parameter deviation {dev:.1e}")
    return checked


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_zero_with_pipeline_parallel():
    results = run_distributed(_pp_worker, 4, timeout=300)
    assert len(results[0]) == 4
    print("\n".join(results[0]))
