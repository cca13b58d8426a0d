"""Capacity planner: per-GPU memory, step time and MFU of a (model, cluster, layout), and a ranking
of the layouts that fit. Pure functions over dataclasses; `tools/plan.py` is the command line.

The `Layout` is training/planning/layout.py, the memory model training/planning/memory.py, the
step-time model training/planning/step_time.py; this file checks layouts with the trainer's rules,
plans and ranks them, and re-exports the three so that `from training.planning.planner import ...`
is the one entry point.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from megazoo.models.config import TransformerConfig
from megazoo.models.recompute import GRANULARITIES
from megazoo.parallel.layout import microbatches_per_step

from megazoo.training.planning.layout import Layout
from megazoo.training.planning.memory import (Memory, PlanError, activation_bytes,  # noqa: F401
                             activation_element_bytes, layer_activation_bytes,
                             memory_per_gpu, model_state_bytes, pipeline_schedule, rank_layer_ids,
                             rank_frozen_params, rank_layers, rank_params, rank_state_bytes,
                             stage_name, stage_params, state_bytes_per_param)
from megazoo.training.planning.step_time import (MATMUL_EFFICIENCY, OPTIMIZER_BYTES_PER_PARAM, Cluster,  # noqa: F401
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
    try:
        cfg.replace(recompute_granularity=layout.recompute_granularity)  # the model's own check
        layout.parallel.validate(layout.world)
        cfg.check_layout(layout.parallel, seq_length=layout.seq_length)
        microbatches_per_step(layout.global_batch_size, layout.micro_batch_size, layout.dp,
                              layout.pp, layout.vpp)
        layout.optimizer.validate(pp=layout.pp)
    except ValueError as e:  # LayoutError, ZeroConfigError, the model's own
        raise PlanError(str(e)) from None


def plan(cfg: TransformerConfig, layout: Layout, cluster: Cluster) -> Plan:
    """The plan of `cfg` at `layout`: a hybrid config (Qwen3.5, Qwen3-Next, Nemotron-H: layers of
    Gated DeltaNet / Mamba-2 / attention) goes to training/planning/hybrid.py, whose `HybridPlan`
    adds per-stage costs and the generation cache to the same fields."""
    from megazoo.models.hybrid_counts import is_hybrid
    if is_hybrid(cfg):
        from megazoo.training.planning import hybrid
        return hybrid.plan(cfg, layout, cluster)
    check_layout(cfg, layout, cluster)
    mem = memory_per_gpu(cfg, layout)
    return Plan(layout, mem, step_time(cfg, layout, cluster),
                mem.total <= cluster.memory_bytes * cluster.usable_fraction)


def candidate_layouts(cfg: TransformerConfig, cluster: Cluster, base: Layout,
                      fixed: dict | None = None):
    """Every valid layout of the cluster's GPUs: `base` with the searched fields replaced (its
    cp, dtype, batch, sequence, optimizer and kernels stay); `fixed` pins searched fields by
    name (e.g. {"tp": 8, "zero_stage": 1}); MoE models also search the expert-parallel size
    (the powers of two dividing num_experts). A hybrid model's pipeline stages get the split of
    its layers at balanced cost (hybrid_balance.py) unless `base` gives a split."""
    fixed = fixed or {}
    pow2 = [x for x in (1, 2, 4, 8, 16) if x <= cluster.gpus_per_node]
    axes = dict(tp=pow2, pp=[x for x in range(1, min(cfg.num_layers, cluster.num_gpus) + 1)
                              if cluster.num_gpus % x == 0],
                vpp=[1, 2], zero_stage=[0, 1, 2, 3], sequence_parallel=[False, True],
                recompute_granularity=[None, *GRANULARITIES], micro_batch_size=[1, 2, 4, 8],
                ep=[x for x in (1, 2, 4, 8, 16, 32, 64) if cfg.num_experts and
                    cfg.num_experts % x == 0 and x <= cluster.num_gpus] or [1])
    unknown = set(fixed) - set(axes) - {"dp"}
    if unknown:
        raise PlanError(f"cannot pin {sorted(unknown)}: the searched fields are {sorted(axes)}")
    axes.update({k: [v] for k, v in fixed.items() if k in axes})
    cp = base.cp
    from megazoo.training.planning.hybrid_balance import proposed_split
    for values in itertools.product(*axes.values()):
        pick = dict(zip(axes, values))
        tp, pp = pick["tp"], pick["pp"]
        if cluster.num_gpus % (tp * pp * cp) or (pick["sequence_parallel"] and tp == 1):
            continue
        dp = cluster.num_gpus // (tp * pp * cp)
        if ("dp" in fixed and fixed["dp"] != dp) or (dp * cp == 1 and pick["zero_stage"] > 0
                                                      and "zero_stage" not in fixed):
            continue  # ZeRO over one replica is stage 0
        layout = base.replace(dp=dp, **pick)
        try:
            layout = proposed_split(cfg, layout)  # mixed layer kinds: stages at equal cost
            check_layout(cfg, layout, cluster)
        except PlanError:
            continue
        yield layout


def rank_layouts(cfg: TransformerConfig, cluster: Cluster, base: Layout,
                 fixed: dict | None = None) -> list[Plan]:
    """The layouts that fit in memory, fastest first (ties: less memory first)."""
    plans = [plan(cfg, lay, cluster) for lay in candidate_layouts(cfg, cluster, base, fixed)]
    fitting = [p for p in plans if p.fits]
    return sorted(fitting, key=lambda p: (p.time.total, p.memory.total))
