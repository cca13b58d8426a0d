"""Capacity planner: per-GPU memory, step time and MFU of a (model, cluster, layout), and a ranking
of the layouts that fit. Pure functions over dataclasses; `tools/plan.py` is the command line.

The memory model (and the `Layout`) is training/planning/memory.py, the step-time model
training/planning/step_time.py; this file checks layouts with the trainer's rules, plans and ranks
them, and re-exports both so that `from training.planning.planner import ...` is the one entry point.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from models.config import TransformerConfig
from parallel.layout import LayoutError, microbatches_per_step
from parallel.zero.config import OptimizerConfig, ZeroConfigError

from training.planning.memory import (Layout, Memory, PlanError, activation_bytes,  # noqa: F401
                             activation_element_bytes, layer_activation_bytes, layout_of_run,
                             memory_per_gpu, model_state_bytes, pipeline_schedule, rank_layer_ids,
                             rank_frozen_params, rank_layers, rank_params, rank_state_bytes,
                             stage_name, stage_params, state_bytes_per_param)
from training.planning.step_time import (MATMUL_EFFICIENCY, OPTIMIZER_BYTES_PER_PARAM, Cluster,  # noqa: F401
                           StepTime, all_to_all_time, step_time)


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool


# ---- validation and ranking --------------------------------------------------------------------

def check_layout(cfg: TransformerConfig, layout: Layout, cluster: Cluster | None = None) -> None:
    """Refuse what the trainer would refuse: the same rules (parallel/layout.py, the optimizer's
    config), so the planner never ranks a layout that cannot be launched."""
    if cluster is not None and layout.world != cluster.num_gpus:
        raise PlanError(f"tp*pp*dp*cp = {layout.world} != {cluster.num_gpus} GPUs")
    if layout.recompute not in ("none", "selective", "full"):
        raise PlanError(f"recompute must be none, selective or full, got {layout.recompute!r}")
    try:
        parallel = layout.parallel_config()
        parallel.validate(layout.world)
        cfg.check_layout(parallel, seq_length=layout.seq_length)
        microbatches_per_step(layout.global_batch, layout.micro_batch, layout.dp, layout.pp,
                              layout.vpp)
        OptimizerConfig(zero_stage=layout.zero).validate(pp=layout.pp)
    except (LayoutError, ZeroConfigError) as e:
        raise PlanError(str(e)) from None


def plan(cfg: TransformerConfig, layout: Layout, cluster: Cluster) -> Plan:
    check_layout(cfg, layout, cluster)
    mem = memory_per_gpu(cfg, layout)
    return Plan(layout, mem, step_time(cfg, layout, cluster),
                mem.total <= cluster.memory_bytes * cluster.usable_fraction)


def candidate_layouts(cfg: TransformerConfig, cluster: Cluster, *, global_batch: int,
                      seq_length: int, fixed: dict | None = None, **common):
    """Every valid layout of the cluster's GPUs; `fixed` pins fields (e.g. {"tp": 8}); MoE
    models also search the expert-parallel size (the powers of two dividing num_experts)."""
    fixed = fixed or {}
    pow2 = [x for x in (1, 2, 4, 8, 16) if x <= cluster.gpus_per_node]
    axes = dict(tp=pow2, pp=[x for x in range(1, min(cfg.num_layers, cluster.num_gpus) + 1)
                              if cluster.num_gpus % x == 0],
                vpp=[1, 2], zero=[0, 1, 2, 3], sequence_parallel=[False, True],
                recompute=["none", "selective", "full"], micro_batch=[1, 2, 4, 8],
                ep=[x for x in (1, 2, 4, 8, 16, 32, 64) if cfg.num_experts and
                    cfg.num_experts % x == 0 and x <= cluster.num_gpus] or [1])
    axes.update({k: [v] for k, v in fixed.items() if k in axes})
    for tp, pp, vpp, zero, sp, rc, mbs, ep in itertools.product(*axes.values()):
        cp = common.get("cp", 1)
        if cluster.num_gpus % (tp * pp * cp) or (sp and tp == 1):
            continue
        dp = cluster.num_gpus // (tp * pp * cp)
        if ("dp" in fixed and fixed["dp"] != dp) or (dp * cp == 1 and zero > 0
                                                      and "zero" not in fixed):
            continue  # ZeRO over one replica is stage 0
        layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep, zero=zero, sequence_parallel=sp,
                        recompute=rc, micro_batch=mbs, global_batch=global_batch,
                        seq_length=seq_length, **common)
        try:
            check_layout(cfg, layout, cluster)
        except PlanError:
            continue
        yield layout


def rank_layouts(cfg: TransformerConfig, cluster: Cluster, *, global_batch: int,
                 seq_length: int, fixed: dict | None = None, **common) -> list[Plan]:
    """The layouts that fit in memory, fastest first (ties: less memory first)."""
    plans = [plan(cfg, lay, cluster) for lay in candidate_layouts(
        cfg, cluster, global_batch=global_batch, seq_length=seq_length, fixed=fixed, **common)]
    fitting = [p for p in plans if p.fits]
    return sorted(fitting, key=lambda p: (p.time.total, p.memory.total))
