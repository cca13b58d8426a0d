"""ZeRO features beyond parity: memory against the ZeRO paper, ZeRO-3's gathered-parameter bound,
fp16 overflow handling, NaN reporting, file (NVMe) offload, checkpoints and collective fallbacks.

One 4-rank world (dp = 4) runs every distributed check; the rest are single-process unit tests.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import (LossScaleConfig, NonFiniteError, OptimizerConfig, ZeroConfigError,
                           build_optimizer)
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from tests.distributed import run_distributed
from tests.helpers import (batch, full_model_parameters, initial_parameters, opt_config,
                           small_gpt, topology, zero_run)
from tests.tolerances import assert_params_equal, assert_trained_close

# The ZeRO paper's model-state bytes per rank for mixed-precision Adam (2-byte weights and
# gradients, 12 bytes of fp32 master + two moments), P parameters, N = dp.
PAPER = {0: lambda P, N: 16 * P, 1: lambda P, N: 4 * P + 12 * P / N,
         2: lambda P, N: 2 * P + 14 * P / N, 3: lambda P, N: 16 * P / N}
# With fp32 gradient buffers (our default: fp32 accumulation) gradients cost 4 bytes, not 2.
FP32_GRADS = {0: lambda P, N: 18 * P, 1: lambda P, N: 6 * P + 12 * P / N,
              2: lambda P, N: 2 * P + 16 * P / N, 3: lambda P, N: 18 * P / N}


def _memory(topo, out):
    cfg = small_gpt(num_layers=4)
    for stage in (0, 1, 2, 3):
        for grad_dtype, table in (("model", PAPER), ("fp32", FP32_GRADS)):
            _, _, _, opt = zero_run(topo, cfg, opt_config(zero_stage=stage, grad_dtype=grad_dtype),
                                    steps=1, dtype=torch.bfloat16)
            rep = opt.memory_report()
            expected = table[stage](rep["numel"], topo.dp)
            ratio = rep["model_states"] / expected
            assert abs(ratio - 1) < 0.05, (stage, grad_dtype, rep, expected)
            out[f"memory zero={stage} grads={grad_dtype}"] = (rep["model_states"], expected, ratio)
    # ZeRO-3: during forward only the root (embeddings, final norm) and the layers gathered at
    # once are materialised: the current one, plus the next one when prefetching.
    for prefetch, layers_at_once in ((True, 2), (False, 1)):
        model = TransformerLanguageModel(cfg, topo)
        opt = build_optimizer(model, topo, opt_config(zero_stage=3, zero3_prefetch=prefetch),
                              torch.bfloat16)
        root, *layers = opt.units
        unit_bytes = [sum(b.padded * b.params.element_size() for b in u.buffers)
                      for u in opt.units]
        full_bytes = sum(unit_bytes)
        bound = unit_bytes[0] + layers_at_once * max(unit_bytes[1:])
        ids, labels = batch(0, topo)
        opt.zero3.peak_gathered_bytes = 0
        loss = model(ids, labels=labels).float().mean()
        forward_peak = opt.zero3.peak_gathered_bytes
        assert forward_peak <= bound < full_bytes, (prefetch, forward_peak, bound, full_bytes)
        # layers released after forward, but the last (its backward comes first)
        assert all(not u.buffers[0].gathered for u in layers[:-1]) and layers[-1].buffers[0].gathered
        opt.backward(loss)
        opt.step()
        assert all(not b.gathered for b in opt.buffers)  # everything released after the step
        # Backward holds the root, the layer in backward and the one prefetched before it.
        step_peak = opt.zero3.peak_gathered_bytes
        assert step_peak <= bound, (prefetch, step_peak, bound)
        out[f"zero3 forward/step peak prefetch={prefetch}"] = (forward_peak, step_peak, bound,
                                                                full_bytes)


def _overflow(topo, out):
    cfg = small_gpt()
    snapshots = {}

    def keep(step, model, opt):
        snapshots[step] = full_model_parameters(model, opt, topo)

    # Hysteresis 2 (the default): the first overflow is skipped without lowering the scale, the
    # second consecutive one halves it. Weights do not move on a skipped step.
    for stage in (1, 3):
        snapshots.clear()
        losses, _, results, opt = zero_run(topo, cfg, opt_config(zero_stage=stage), steps=5,
                                           inject_inf_at=(2, 3), on_step=keep, dtype=torch.float16)
        scales = [r.loss_scale for r in results]
        assert [r.skipped for r in results] == [False, False, True, True, False], results
        assert scales[:4] == [2.0 ** 16] * 4 and scales[4] == 2.0 ** 15, scales
        assert "step 3" in results[2].reason and "step 4" in results[3].reason
        assert_params_equal(snapshots[2], snapshots[1], "skipped step 3")
        assert_params_equal(snapshots[3], snapshots[1], "skipped step 4")
        assert opt.applied_steps == 3 and torch.isfinite(torch.tensor(losses[4]))
        assert (snapshots[4]["layers.0.mlp.fc1.weight"]
                != snapshots[3]["layers.0.mlp.fc1.weight"]).any()  # training continued
    # Hysteresis 1: one overflow halves the scale at once.
    ls = LossScaleConfig(hysteresis=1)
    _, _, results, _ = zero_run(topo, cfg, opt_config(zero_stage=2, loss_scale=ls), steps=3,
                                inject_inf_at=(1,), dtype=torch.float16)
    assert [r.skipped for r in results] == [False, True, False]
    assert [r.loss_scale for r in results] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15]
    # bf16 has no scaler: a NaN is reported with its step and skipped, or raised if asked.
    _, _, results, _ = zero_run(topo, cfg, opt_config(zero_stage=2), steps=3,
                                inject_inf_at=(1,), dtype=torch.bfloat16)
    assert [r.skipped for r in results] == [False, True, False]
    assert results[1].reason.startswith("step 2: non-finite")
    with pytest.raises(NonFiniteError, match="step 2"):
        zero_run(topo, cfg, opt_config(zero_stage=1, raise_on_nonfinite=True), steps=2,
                 inject_inf_at=(1,))
    out["overflow"] = "ok"


def _offload(topo, out, tmp):
    cfg = small_gpt()
    for stage, dtype in ((1, torch.float32), (2, torch.bfloat16), (3, torch.float16)):
        base = dict(zero_stage=stage, bucket_numel=2000)
        mem_losses, mem_params, _, mem_opt = zero_run(topo, cfg, opt_config(**base), dtype=dtype)
        # nvme with one staging buffer (no read-ahead), then two (read-ahead, the default).
        for offload, resident in (("cpu", 2), ("nvme", 1), ("nvme", 2)):
            losses, params, _, opt = zero_run(topo, cfg, opt_config(
                **base, offload=offload, offload_dir=os.path.join(tmp, f"swap{stage}"),
                offload_resident_buckets=resident), dtype=dtype)
            tag = f"offload={offload} resident={resident} zero={stage} {dtype}"
            assert losses == mem_losses, tag
            assert_params_equal(params, mem_params, tag)
        in_memory = sum(t.nbytes for s in mem_opt.states.states for t in s.values())
        rep = opt.memory_report()
        assert rep["offload_files"] == in_memory, (rep, in_memory)
        peak = opt.states.peak_resident_bytes
        widest = max(4 * sum(s.values()) for s in opt.states.specs)
        assert 0 < peak <= rep["offload_resident"] == 2 * widest, (peak, rep, widest)
        assert len(opt.buffers) >= 8 and peak * 3 < in_memory, (len(opt.buffers), peak, in_memory)
        files = [f for f in os.listdir(os.path.join(tmp, f"swap{stage}"))
                 if f.startswith(f"rank{topo.rank:05d}")]
        assert len(files) == len(opt.buffers) * (2 + (dtype != torch.float32)), files
        out[f"nvme zero={stage} {dtype}"] = (peak, in_memory, len(opt.buffers))


def _checkpoint_and_fallbacks(topo, out):
    cfg = small_gpt()
    for stage in (1, 3):
        ocfg = opt_config(zero_stage=stage)
        saved = {}

        def keep(step, model, opt):
            if step == 1:
                saved.update(opt.state_dict())
        _, want, _, _ = zero_run(topo, cfg, ocfg, steps=3, on_step=keep, dtype=torch.bfloat16)
        assert all(isinstance(v, torch.Tensor) for v in saved.values())
        assert saved["bucket0.ranges"].shape[1] == 4
        model = TransformerLanguageModel(cfg, topo)
        opt = build_optimizer(model, topo, ocfg, torch.bfloat16)
        opt.load_state_dict(saved)
        assert opt.applied_steps == 2
        ids, labels = batch(2, topo)
        opt.backward(model(ids, labels=labels).float().mean())
        opt.step()
        assert_params_equal(full_model_parameters(model, opt, topo), want, f"resume zero={stage}")
    # Overlap: with many buckets, reductions start (and some land) during backward, before step.
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, opt_config(zero_stage=2, bucket_numel=2000))
    ids, labels = batch(0, topo)
    opt.backward(model(ids, labels=labels).float().mean())
    landed = [bool(b.grad_shard.any()) for b in opt.buffers]
    assert len(opt.buffers) >= 10 and sum(landed) >= len(opt.buffers) - 2, landed
    assert len(opt.grad_sync._inflight) <= opt.cfg.max_inflight_buckets
    opt.step()
    out["checkpoint+overlap"] = "ok"


def _features_worker(rank, tmp):
    topo = topology()
    out = {}
    _memory(topo, out)
    _overflow(topo, out)
    _offload(topo, out, tmp)
    _checkpoint_and_fallbacks(topo, out)
    return out


def test_zero_features_dp4():
    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(_features_worker, 4, tmp, timeout=300)[0]
    # Every part ran to its end (each asserts on the way; a part that returned early would be
    # missing here).
    expected = {f"memory zero={s} grads={g}" for s in range(4) for g in ("model", "fp32")}
    expected |= {f"zero3 forward/step peak prefetch={p}" for p in (True, False)}
    expected |= {f"nvme zero={s} {d}" for s, d in ((1, torch.float32), (2, torch.bfloat16),
                                                    (3, torch.float16))}
    expected |= {"overflow", "checkpoint+overlap"}
    assert set(out) == expected, set(out) ^ expected
    for k, v in out.items():
        print(k, v)


# ---- single process ------------------------------------------------------------------------

def test_dynamic_loss_scaler():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=8.0, growth_interval=3, hysteresis=2,
                                          min_scale=2.0))
    s.update(True)
    assert s.scale == 8.0  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # never below the minimum
    for _ in range(3):
        s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2  # growth refills the hysteresis
    s.update(True)
    assert s.scale == 4.0
    t = DynamicLossScaler(LossScaleConfig())
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (4.0, 0, 1)


@pytest.mark.parametrize("cfg, pp, match", [
    (OptimizerConfig(zero_stage=3), 2, "--zero-stage 3 does not compose with --pipeline"),
    (OptimizerConfig(zero_stage=4), 1, "--zero-stage must be"),
    (OptimizerConfig(zero_stage=1, offload="nvme"), 1, "--offload-dir"),
    (OptimizerConfig(offload="cpu"), 1, "--zero-stage >= 1"),
])
def test_bad_configs_name_the_flag(cfg, pp, match):
    with pytest.raises(ZeroConfigError, match=match):
        cfg.validate(pp)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_single_process_matches_torch_optimizers(name):
    """dp = 1: the flat-shard AdamW / SGD (momentum, decay) equal torch.optim's."""
    cfg, topo = small_gpt(), ParallelTopology.single()
    ref = TransformerLanguageModel(cfg, topo)
    model = TransformerLanguageModel(cfg, topo)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2]},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    if name == "adamw":
        torch_opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-6, **hyper)
        opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=1, betas=(0.9, 0.95),
                                                           eps=1e-6, **hyper))
    else:
        torch_opt = torch.optim.SGD(groups, momentum=0.9, **hyper)
        opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=2, optimizer="sgd",
                                                           momentum=0.9, **hyper))
    for step in range(3):
        ids, labels = batch(step)
        ref(ids, labels=labels).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
        opt.backward(model(ids, labels=labels).mean())
        opt.step()
        opt.zero_grad()
    got = {n: full_tensor(p, topo).detach() for n, p in model.named_parameters()}
    want = {n: full_tensor(p, topo).detach() for n, p in ref.named_parameters()}
    assert_trained_close(got, want, initial_parameters(cfg), name, hyper["lr"])
