"""DeepSeek-V3 multi-token prediction under TP + SP + EP and PP + EP against the unsharded model.

A model of MLA attention, one dense and one DeepSeek MoE layer and two prediction depths (MoE
layers), two microbatches per step, in one 4-rank gloo world:

* tp2 + SP, ep2, dp2 (untied head), ZeRO-3 (each depth a unit gathered on use): the depths'
  projection column-parallel, the shared vocab-parallel embedding and head, the MoE depth's
  experts split over EP;
* pp2, ep2, dp2, untied (DeepSeek-V3's), ZeRO-1: the depths on the last stage, with a copy of the
  embedding kept equal to the first stage's through the embedding group, beside its own head;
* pp2, ep2, dp2 with tied embeddings, ZeRO-1: that copy is also the head.

Against the reference (the unsharded model on each DP rank's share of the batch, gradients
averaged over DP, clip_grad_norm_, torch AdamW): the main loss of each of 2 steps and each
depth's MTP loss, every gradient as the optimizer holds it after the reductions of step 1, the
gradient norm of every step, and every parameter after the 2 steps (`assert_trained_close`).
The reference runs once, in the test's process.
"""
from __future__ import annotations

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.models.multi_token_prediction import mtp_modules, set_mtp_loss_scale
from megazoo.parallel.pipeline.partition import chunk_prefix, partition
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import build_optimizer
from tests.distributed import run_distributed
from tests.helpers import (HYPER, SEQ, accumulated_backward, batch, checked_step, dp_mean,  # noqa: F401
                           one_thread, opt_config, reference_adamw, topology)  # one_thread: autouse
from tests.tolerances import assert_trained_close

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 2
MICROBATCHES, DP = 2, 2  # per step; both layouts of the 4-rank world have dp 2


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(
        vocab_size=101, hidden_size=32, num_layers=2, num_attention_heads=4, normalization="rmsnorm",
        activation="swiglu", position_embedding="rope", bias=False, tie_word_embeddings=False,
        make_vocab_size_divisible_by=8, layernorm_epsilon=1e-6, ffn_hidden_size=48,
        kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_norm_topk_prob=True,
        moe_shared_expert_intermediate_size=12, moe_first_dense_layers=1,
        mtp_num_layers=2, mtp_loss_scaling_factor=0.3, seed=13), **kw})


def _depth_losses(chunks) -> list[float] | None:
    """Each depth's mean loss since the last call (resets), or None without the depths here."""
    blocks = mtp_modules(chunks)
    if not blocks:
        return None
    totals = blocks[0].stats.totals.clone()
    blocks[0].stats.reset()
    return (totals[1:] / totals[0]).tolist()


def _reference(cfg):
    """(main losses, depth losses, step-1 grads, norms, initial and trained params) of the
    unsharded model, run once in the test's process: DP rank r's microbatches are chunks
    r * m .. r * m + m - 1 of the global batch, so averaging over DP x microbatches is averaging
    over those dp * m chunks, in one process."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, single)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    initial = {n: full_tensor(p, single).clone() for n, p in named}
    opt = reference_adamw(named)
    shares = DP * MICROBATCHES
    set_mtp_loss_scale([model], 1.0 / shares)
    losses, depths, norms, grads = [], [], [], None
    for step in range(STEPS):
        total = accumulated_backward(model, *batch(step), shares)
        if step == 0:
            grads = {n: full_tensor(p, single, p.grad).clone() for n, p in named}
        norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], HYPER["clip_grad"]).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
        depths.append(_depth_losses([model]))
    return losses, depths, grads, norms, initial, {n: full_tensor(p, single).clone() for n, p in named}


def _run(topo, cfg, ref, stage: int, tag: str) -> tuple[int, int]:
    from megazoo.training.run.step import activation_shape
    ref_losses, ref_depths, ref_grads, ref_norms, initial, ref_params = ref
    specs = partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]
    chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs()) for s in specs]
    opt = build_optimizer(chunks, topo, opt_config(zero_stage=stage))
    shape = activation_shape(topo, SEQ, batch(0, topo)[0].shape[0] // MICROBATCHES, cfg.hidden_size)
    grads_checked = depths_checked = 0
    for step in range(STEPS):
        grads_checked += checked_step(chunks, topo, opt, step, MICROBATCHES, shape, ref_losses,
                                      ref_norms, ref_grads if step == 0 else None, tag)
        depths = _depth_losses(chunks)
        if depths is not None:  # the last stage: the depths' losses of this DP rank's share
            torch.testing.assert_close(torch.tensor([dp_mean(v, topo) for v in depths]),
                                       torch.tensor(ref_depths[step]), **TOL,
                                       msg=f"{tag} depth losses step {step}")
            depths_checked += len(depths)
    dp_full = opt.full_parameters()
    for c, chunk in enumerate(chunks):
        prefix = chunk_prefix(c, len(chunks))
        assert_trained_close({chunk.canonical_name(n): full_tensor(p, topo, dp_full[prefix + n])
                              for n, p in chunk.named_parameters() if p.requires_grad}, ref_params,
                             initial, tag, HYPER["lr"])
    return grads_checked, depths_checked


def _world(rank, layouts):
    return [_run(topology(**kw), _config(**model), ref, stage, f"{kw} zero {stage}")
            for kw, model, stage, ref in layouts]


def test_mtp_under_tensor_sequence_expert_and_pipeline_parallelism_equals_unsharded():
    untied, tied = {}, dict(tie_word_embeddings=True)
    refs = {"untied": _reference(_config(**untied)), "tied": _reference(_config(**tied))}
    layouts = [(dict(tp=2, sequence_parallel=True, ep=2), untied, 3, refs["untied"]),
               (dict(pp=2, ep=2), untied, 1, refs["untied"]),
               (dict(pp=2, ep=2), tied, 1, refs["tied"])]
    results = run_distributed(_world, 4, layouts, timeout=600)
    for rank, per_layout in enumerate(results):
        assert len(per_layout) == 3
        assert all(grads > 0 for grads, _ in per_layout)
        assert per_layout[0][1] == 2 * STEPS  # every TP rank holds the depths
    # under pp2 the depths live on the last stage only (ranks 2, 3 of the pp2 x dp2 layout)
    for i in (1, 2):
        assert sorted(r[i][1] for r in results) == [0, 0, 2 * STEPS, 2 * STEPS]
