"""The dry run of MoE models (training/run/dry_run.py with training/planning/meta_kernels.py's
balanced routing) and the planner's parameter terms for them (training/planning/parameters.py).

* Mixtral-, Qwen2-MoE- and DeepSeek-V3-shaped layouts (TP + SP, EP, PP, an uneven split, ZeRO-1,
  full recompute, an expert capacity, a multi-token prediction depth; bf16, and fp32) step on meta tensors: each rank's model states are the planner's to the byte,
  its activations within the dry-run tests' 5% of the planner's, its schedule at its bound.
* DeepSeek-V3 671B at its published layout (pp16, ep64, ZeRO-1 dp128 on 2048 ranks): the first
  rank (3 dense layers + 1 MoE) stepped and checked the same way.
* The planner's parameters of a rank equal those of the real model built on meta, exactly
  (trained and frozen expert biases apart), and with DeepSeek-V3's multi-token prediction module
  the total is the released checkpoint's 685B within 0.5%.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.tools import dry_run as D
from megazoo.training.planning import planner
from megazoo.training.planning.parameters import mtp_parameters, total_parameters
from megazoo.training.planning.reference_runs import published_layouts

TINY_RUN = ["--bf16", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16"]
QWEN2_MOE = ["--model", "qwen2-moe-a2.7b", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--num-experts", "8",
             "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64",
             "--vocab-size", "1000", "--max-position-embeddings", "256"]
CASES = {  # name: (world, flags)
    "mixtral tp2 sp pp2 ep2 capacity": (8, ["--model", "moe-tiny", "--tensor-model-parallel-size",
                                            "2", "--sequence-parallel",
                                            "--pipeline-model-parallel-size", "2",
                                            "--expert-model-parallel-size", "2", "--zero-stage",
                                            "1", "--moe-expert-capacity-factor", "1.0"]),
    "qwen2-moe ep4 full recompute": (8, QWEN2_MOE + ["--expert-model-parallel-size", "4",
                                                     "--zero-stage", "1",
                                                     "--recompute-granularity", "full"]),
    "deepseek-v3 pp2 uneven ep4": (8, ["--model", "deepseek-v3-tiny",
                                       "--pipeline-model-parallel-size", "2",
                                       "--decoder-first-pipeline-num-layers", "1",
                                       "--decoder-last-pipeline-num-layers", "3",
                                       "--expert-model-parallel-size", "4", "--zero-stage", "1",
                                       "--mtp-num-layers", "1", "--recompute-granularity", "full"]),
    # fp32: torch's meta grouped matmul takes bf16 only (parallel/kernels/grouped_matmul.py)
    "mixtral ep2 fp32": (2, ["--model", "moe-tiny", "--expert-model-parallel-size", "2"]),
    # Mamba-2, attention, squared-ReLU dense and MoE layers in one stack
    "nemotron-h moe ep2 tp2": (4, ["--model", "nemotron-h-moe-tiny", "--tensor-model-parallel-size",
                                   "2", "--expert-model-parallel-size", "2"]),
}


def _check(report: D.RankReport) -> None:
    mem = report.memory
    assert mem["model_states"] == sum(report.predicted_states)
    assert (mem["params"], mem["grads"]) == report.predicted_states[:2]
    assert report.run_microbatches > 0 and report.activation_units == report.activation_bound
    assert report.activation_bytes == pytest.approx(report.predicted_activations, rel=0.05)


def test_moe_layouts_step_on_meta_as_the_planner_predicts():
    checked = []
    for name, (world, flags) in CASES.items():
        dtype = [f for f in TINY_RUN if f != "--bf16" or not name.endswith("fp32")]
        _, run = D.parse(["--world-size", str(world), *flags, *dtype])
        assert run.model.num_experts, name
        grid = run.parallel.grid(world)
        for rank in D.chosen_ranks("first,last", grid):
            report = D.dry_run_rank(run, world, rank, D.model_provider(run))
            _check(report)
            checked.append((name, rank))
    assert len(checked) == 2 * len(CASES)


def test_deepseek_v3_671b_first_rank_of_the_published_layout():
    layout = next(x for x in published_layouts() if x.name == "DeepSeek-V3")
    _, run = D.parse(["--world-size", str(layout.world_size), *layout.flags])
    assert run.model.num_parameters() == pytest.approx(layout.params, rel=0.005)
    report = D.dry_run_rank(run, layout.world_size, 0, D.model_provider(run))
    _check(report)
    assert [c[1:3] for c in report.chunks] == [(0, 4)]  # 3 dense layers and the first MoE one
    assert len(report.groups["ep"]) == 64 and len(report.groups["dp"]) == 128


def _meta_model_params(cfg) -> tuple[int, int]:
    """(trained, frozen) parameters of the unsharded model built on meta."""
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelTopology
    with torch.device("meta"):
        model = build_model(cfg, ParallelTopology.single(device="meta"))
    params = list(model.parameters())
    return (sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() for p in params if not p.requires_grad))


def test_planner_parameters_are_the_meta_models():
    from megazoo.models.presets import preset
    _, qwen = D.parse(["--world-size", "1", *QWEN2_MOE])
    configs = {"mixtral": preset("moe-tiny"), "qwen2-moe": qwen.model,
               "deepseek-v3": preset("deepseek-v3-tiny"),
               "deepseek-v3 no q latent": preset("deepseek-v3-tiny", q_lora_rank=None)}
    for name, cfg in configs.items():
        dense, expert = planner.rank_params(cfg, planner.Layout(), 0)
        trained, frozen = _meta_model_params(cfg)
        assert dense + expert == trained, name
        assert planner.rank_frozen_params(cfg, planner.Layout(), 0) == frozen, name
        assert (frozen > 0) == (cfg.family == "deepseek_v3"), name
        assert total_parameters(cfg) == cfg.num_parameters() + frozen, name  # unpadded, no MTP


def test_multi_token_prediction_counts_on_the_last_stage():
    """One MTP module = enorm, hnorm, eh_proj [h, 2h], a layer shaped as the last, a final norm
    (the model config's `mtp_parameters`, split into dense and expert parts); under PP the last
    stage also holds a copy of the word embedding."""
    from megazoo.models.presets import preset
    tiny = preset("deepseek-v3-tiny")
    assert mtp_parameters(tiny) == (0.0, 0.0)
    h, last = tiny.hidden_size, tiny.num_layers - 1
    tiny.mtp_num_layers = 1
    dense, expert = mtp_parameters(tiny)
    assert dense + expert == 3 * h + 2 * h * h + tiny.layer_parameters(layer=last)
    assert expert == tiny.expert_parameters(last) > 0
    layout = planner.Layout.of(pp=2)
    without = preset("deepseek-v3-tiny")
    assert planner.rank_params(tiny, layout, 0) == planner.rank_params(without, layout, 0)
    # the last stage also keeps a copy of the (untied) word embedding for the depths' inputs
    copy = tiny.padded_vocab_size(1) * h
    assert not tiny.tie_word_embeddings
    assert [a - b for a, b in zip(planner.rank_params(tiny, layout, 1),
                                  planner.rank_params(without, layout, 1))] == [dense + copy, expert]
    v3 = preset("deepseek-v3")
    v3.mtp_num_layers = 1
    # 671B main model + 14B MTP (whose checkpoint also stores copies of the shared embedding and
    # head: 1.85B of those 14B)
    assert total_parameters(v3) == pytest.approx(685e9, rel=0.005)


def test_balanced_routing_leaves_the_model_as_it_was():
    from megazoo.models.presets import preset
    from megazoo.models.registry import build_model
    from megazoo.parallel.expert_parallel import TokenDispatcher
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.training.planning.meta_kernels import BalancedDispatcher, balanced_counts, balanced_routing
    assert balanced_counts(10, 4) == [3, 3, 2, 2]
    with torch.device("meta"):
        model = build_model(preset("moe-tiny", num_layers=2), ParallelTopology.single(device="meta"))
    layers = [m for m in model.modules() if hasattr(m, "dispatcher")]
    with balanced_routing([model]):
        assert all(type(m.dispatcher) is BalancedDispatcher for m in layers)
        assert torch.bincount(torch.empty(6, dtype=torch.long, device="meta"), minlength=8).shape == (8,)
    assert len(layers) == 2 and all(type(m.dispatcher) is TokenDispatcher for m in layers)
    with pytest.raises(NotImplementedError):
        torch.bincount(torch.empty(6, dtype=torch.long, device="meta"), minlength=8)
