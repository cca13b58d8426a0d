"""Expert parallelism with TP, SP, PP and ZeRO 0-3 against a single-process MoE model, in gloo worlds.

The reference is the unsharded model (all experts, ep = 1) run on each data-parallel rank's share
of the batch, gradients averaged over DP, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW.
For every layout and ZeRO stage, dropless and with capacity dropping, over 3 optimizer steps:

* the LM loss of every step and each MoE layer's auxiliary (load-balancing + z) loss;
* every gradient as the optimizer holds it after the reductions of step 1 (this rank's shard of
  every bucket: dense ones reduced over DP, expert ones over expert data parallelism only);
* the global gradient norm of every step (every parameter counted once: experts over EP);
* every parameter after 3 AdamW steps (clipping active)

equal the reference within rtol = atol = 1e-5 (fp32), in two 4-rank worlds and one 8-rank world
(tp2 + SP, pp2, ep2, dp2; ZeRO-1, capacity dropping). AdamW's eps is 1e-6 as in test_zero.py.
Every layer is an MoE layer: 4 under pipeline parallelism (one per virtual stage at pp2 x vpp2),
2 otherwise.
"""
from __future__ import annotations

import torch

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.models.moe import moe_layers, set_aux_loss_scale
from megazoo.parallel.pipeline.partition import chunk_prefix, partition
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import build_optimizer
from tests.distributed import all_reduce_each, run_distributed
from tests.helpers import (HYPER, SEQ, STEPS, batch, checked_step, dp_mean, initial_parameters,
                           opt_config, topology)
from tests.hf_models import moe_config
from tests.tolerances import assert_trained_close
from megazoo.training.run.step import activation_shape

TOL = dict(rtol=1e-5, atol=1e-5)


def _config(layers: int, **kw):
    return moe_config(num_layers=layers, vocab_size=101, moe_shared_expert_intermediate_size=16,
                      moe_shared_expert_gate=True, seed=11, **kw)


def _moe_names(model) -> dict[int, str]:
    ids = {id(m) for m in moe_layers(model)}
    return {id(l): n for n, l in model.named_modules() if id(l) in ids}


def _aux(model, dropped: list | None = None) -> dict[int, float]:
    """Mean aux + z loss per MoE layer over the forwards since the last call (resets); adds the
    dropped assignments to `dropped`."""
    out = {}
    for layer in moe_layers(model):
        n = int(layer.stats.totals[0])
        out[id(layer)] = (layer.stats.totals[3] + layer.stats.totals[4]).item() / max(n, 1)
        if dropped is not None:
            dropped.append(layer.stats.totals[2].item())
        layer.stats.reset()
    return out


def reference(topo, cfg, microbatches: int):
    """(losses, grads of step 1, norms, params, aux per step per layer name) of the plain run."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, single)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                              "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    set_aux_loss_scale([model], 1.0 / microbatches)
    names = _moe_names(model)
    losses, norms, auxes, grads = [], [], [], None
    for step in range(STEPS):
        ids, labels = batch(step, topo)
        total = 0.0
        for i, y in zip(ids.chunk(microbatches), labels.chunk(microbatches)):
            loss = model(i, labels=y).mean()
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        all_reduce_each([p.grad for _, p in named], topo.dp_group)
        for _, p in named:
            p.grad /= topo.dp
        if step == 0:
            grads = {n: full_tensor(p, single, p.grad).clone() for n, p in named}
        norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], HYPER["clip_grad"]).item())
        opt.step()
        opt.zero_grad()
        losses.append(dp_mean(total, topo))
        auxes.append({names[k]: v for k, v in _aux(model).items()})
    return losses, grads, norms, {n: full_tensor(p, single).clone() for n, p in named}, auxes


def parallel_run(topo, cfg, stage: int, microbatches: int, ref, tag: str,
                 schedule: str = "1f1b") -> str:
    ref_losses, ref_grads, ref_norms, ref_params, ref_aux = ref
    specs = partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]
    chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs()) for s in specs]
    opt = build_optimizer(chunks, topo, opt_config(zero_stage=stage))
    names = {k: n for c in chunks for k, n in _moe_names(c).items()}
    shape = activation_shape(topo, SEQ, batch(0, topo)[0].shape[0] // microbatches, cfg.hidden_size)
    grads_checked, dropped = 0, []
    for step in range(STEPS):
        grads_checked += checked_step(chunks, topo, opt, step, microbatches, shape, ref_losses,
                                      ref_norms, ref_grads if step == 0 else None, tag, schedule)
        for c in chunks:
            for k, v in _aux(c, dropped).items():
                torch.testing.assert_close(v, ref_aux[step][names[k]], **TOL,
                                           msg=f"{tag} aux {names[k]} step {step}")
    dp_full = opt.full_parameters()
    for c, chunk in enumerate(chunks):
        prefix = chunk_prefix(c, len(chunks))
        assert_trained_close({chunk.canonical_name(n): full_tensor(p, topo, dp_full[prefix + n])
                              for n, p in chunk.named_parameters()}, ref_params,
                             initial_parameters(cfg), tag, HYPER["lr"])
    assert (sum(dropped) > 0) == (cfg.moe_expert_capacity_factor is not None), tag
    return f"{tag}: {grads_checked} gradient slices, {sum(dropped):.0f} assignments dropped"


def _world(rank, layouts):
    out = []
    for kw, stages, capacity, microbatches, schedule in layouts:
        topo = topology(**kw)
        # 4 layers where a pipeline splits them (pp2 x vpp2: one per chunk), else 2
        cfg = _config(4 if topo.pp > 1 else 2, moe_expert_capacity_factor=capacity)
        ref = reference(topo, cfg, microbatches)
        for stage in stages:
            tag = f"{kw} dp={topo.dp} zero={stage} capacity={capacity} mb={microbatches}"
            out.append(parallel_run(topo, cfg, stage, microbatches, ref, tag, schedule))
    return out


# (layout, ZeRO stages, capacity factor, microbatches, pipeline schedule)
TP_EP = [(dict(tp=2, ep=2, sequence_parallel=True), (0, 1, 2, 3), None, 1, "1f1b"),
         (dict(tp=2, ep=2), (1,), 0.75, 2, "1f1b"),
         (dict(ep=4), (0, 1, 2, 3), None, 1, "1f1b"),
         (dict(ep=4), (2,), 0.75, 1, "1f1b"),
         (dict(ep=2), (0, 3), 0.75, 2, "1f1b")]  # dp 4: expert data parallelism of 2
PP_EP = [(dict(pp=2, ep=2), (0, 1, 2), None, 2, "1f1b"),
         (dict(pp=2, ep=2), (1,), 0.75, 2, "1f1b"),
         (dict(pp=2, vpp=2, ep=2), (2,), None, 2, "interleaved")]


def test_expert_parallel_with_tensor_sequence_and_data_parallel():
    results = run_distributed(_world, 4, TP_EP, timeout=600)
    assert len(results[0]) == 12
    print("\n".join(results[0]))


def test_expert_parallel_with_pipeline_parallel():
    results = run_distributed(_world, 4, PP_EP, timeout=600)
    assert len(results[0]) == 5
    print("\n".join(results[0]))


TP_PP_EP = [(dict(tp=2, pp=2, ep=2, sequence_parallel=True), (1,), 0.75, 2, "1f1b")]


def test_expert_parallel_with_tensor_pipeline_and_data_parallel_8_ranks():
    results = run_distributed(_world, 8, TP_PP_EP, timeout=600)
    assert len(results[0]) == 1
    print("\n".join(results[0]))
