"""LoRA, DPO and export flags refused in one line naming the flag and the fix, before any work."""
from __future__ import annotations

import pytest

from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser

LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "61", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3"]


def _config(*extra, world=1):
    return to_run_config(build_parser().parse_args(LLAMA + [str(a) for a in extra]), world_size=world)


def test_lora_and_dpo_settings_map(tmp_path):
    run = _config("--mock-data", "--lora-rank", 4, "--lora-alpha", 16, "--lora-target-modules", "q_proj,down_proj")
    assert (run.lora.rank, run.lora.alpha, run.lora.targets) == (4, 16.0, ("q_proj", "down_proj"))
    assert _config("--mock-data", "--lora-rank", 2, "--lora-target-modules", "all-linear").lora.targets[-1] == "down_proj"
    assert _config("--mock-data").lora is None
    (tmp_path / "p_preference.json").write_text("{}")
    run = _config("--lora-rank", 2, "--dpo", "--data-path", tmp_path / "p", "--eval-iters", 0,
                  "--dpo-loss-type", "robust", "--dpo-label-smoothing", 0.1)
    assert (run.dpo.loss_type, run.dpo.label_smoothing, run.dpo.reference, run.data.dpo) == ("robust", 0.1, None, True)


@pytest.mark.parametrize("extra, match", [
    (["--mock-data", "--lora-target-modules", "q_proj"], "--lora-target-modules needs --lora-rank"),
    (["--mock-data", "--lora-rank", 4, "--lora-target-modules", "qkv"], r"unknown \['qkv'\]; choose from q_proj"),
    (["--mock-data", "--lora-rank", 0, "--lora-alpha", 4], "--lora-alpha needs --lora-rank"),
    (["--mock-data", "--lora-rank", 4, "--lora-dropout", 1.0], r"--lora-dropout must be in \[0, 1\)"),
    (["--mock-data", "--lora-init", "/nonexistent"], "--lora-init /nonexistent: needs adapter_config.json"),
    (["--mock-data", "--lora-rank", 4, "--tensor-model-parallel-size", 4, "--num-attention-heads", 8],
     "with --tensor-model-parallel-size 4 > 2 key/value groups"),
    (["--mock-data", "--dpo"], "--dpo needs one --data-path"),
    (["--data-path", "x", "--dpo", "--sft"], "--dpo and --sft exclude each other"),
    (["--data-path", "x", "--dpo", "--eval-iters", 0, "--micro-batch-size", 1, "--global-batch-size", 4],
     "--micro-batch-size 1 must be even"),
    (["--data-path", "x", "--dpo", "--eval-iters", 0], "--dpo without LoRA needs its reference model"),
    (["--data-path", "x", "--dpo", "--eval-iters", 0, "--lora-rank", 2, "--dpo-label-smoothing", 0.1],
     "--dpo-label-smoothing is used by --dpo-loss-type robust only"),
    (["--mock-data", "--dpo-beta", 0.5], "--dpo-\\* flags need --dpo"),
])
def test_refused_in_one_line(extra, match):
    with pytest.raises(ArgumentError, match=match):
        _config(*extra, world=4 if "--tensor-model-parallel-size" in extra else 1)


def test_gpt2_lora_takes_peft_gpt2_names():
    gpt = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--max-position-embeddings", "16", "--vocab-size", "61", "--mock-data", "--lora-rank", "4",
           "--train-iters", "1"]
    assert to_run_config(build_parser().parse_args(gpt), world_size=1).lora.targets == ("c_attn",)
    with pytest.raises(ArgumentError, match=r"unknown \['q_proj'\]; choose from c_attn, c_proj, c_fc"):
        to_run_config(build_parser().parse_args(gpt + ["--lora-target-modules", "q_proj"]), world_size=1)


def test_planner_counts_the_adapters_only_as_trained():
    """The optimizer's numel, gradients and states of a LoRA model are the planner's adapter
    terms; the frozen base only counts in the weights."""
    import math

    import torch
    from megazoo.models.lora import apply_lora
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import build_optimizer
    from megazoo.parallel.zero.config import OptimizerConfig
    from megazoo.training.planning.layout import Layout
    from megazoo.training.planning.memory import rank_params, rank_state_bytes
    from megazoo.training.planning.parameters import lora_parameters
    run = _config("--mock-data", "--lora-rank", 4, "--lora-target-modules", "q_proj,v_proj,o_proj,up_proj,down_proj")
    topo = ParallelTopology.from_config(ParallelConfig())
    for dtype in ("float32", "bfloat16"):
        model = build_model(run.model.replace(params_dtype=dtype), topo)
        apply_lora([model], run.lora, run.model, topo, None, 0)
        opt = build_optimizer(model, topo, OptimizerConfig(), getattr(torch, dtype))
        rep = opt.memory_report()
        layout = Layout.of(params_dtype=dtype, lora=run.lora)
        w, g, o = rank_state_bytes(run.model, layout, 0)
        assert rep["numel"] == lora_parameters(run.model, run.lora, 1, range(2))
        assert (rep["grads"], rep["master_params"] + rep["optimizer_states"]) == (g, o)
        frozen = sum(rank_params(run.model, layout, 0)) * layout.dtype.itemsize
        assert math.isclose(w, rep["params"] + frozen)


def test_planner_counts_a_loaded_reference_as_frozen_weights(tmp_path):
    """DPO without LoRA (and GRPO with a KL reference) hold a second, frozen copy of the model's
    weights: the planner's weights grow by exactly the model's parameter bytes, nothing else."""
    import math

    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.planning.layout import Layout
    from megazoo.training.planning.memory import rank_state_bytes
    (tmp_path / "p_preference.json").write_text("{}")
    dpo = ["--data-path", tmp_path / "p", "--dpo", "--eval-iters", 0]
    full = _config(*dpo, "--dpo-reference", tmp_path)
    adapters = _config(*dpo, "--lora-rank", 2)
    plain = _config("--mock-data")
    assert [Layout.of_run(r, 1).reference for r in (full, adapters, plain)] == [True, False, False]
    model = build_model(full.model, ParallelTopology.from_config(ParallelConfig()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for a, b in ((full, plain), (adapters, adapters)):
        with_ref, without = (rank_state_bytes(r.model, Layout.of_run(r, 1), 0) for r in (a, b))
        extra = weight_bytes if a is full else 0
        assert math.isclose(with_ref[0], without[0] + extra) and with_ref[1:] == without[1:]
