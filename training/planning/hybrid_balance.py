"""A pipeline split of a hybrid model's layers at balanced cost (the planner's proposal for
--pipeline-model-parallel-layout).

Layer kinds cost very differently: a Nemotron-H stage of attention and MLP layers takes far longer
per microbatch than one of Mamba-2 layers, so splitting by layer count leaves the slowest stage
setting the pipeline's slot (training/planning/hybrid.py `step_time`). Here each layer is weighed
by the planner's own forward + backward FLOPs of its kind (`hybrid.layer_flops`), the last block
also carries the output head, and the layers are cut into the pp x vpp contiguous blocks whose
heaviest block is lightest (an exact min-max partition by dynamic programming; every block keeps
at least one layer). The result is the tuple of layers per block that `ParallelConfig.stage_layout`
holds and `format_layout` prints as the flag.
"""
from __future__ import annotations

from megazoo.parallel.pipeline.layer_layout import FLAG, format_layout

from megazoo.training.planning import hybrid
from megazoo.training.planning.layout import Layout


def layer_costs(shape, layout: Layout) -> list[float]:
    """FLOPs per microbatch on one rank of every layer, in model order."""
    return [hybrid.layer_flops(shape, layout, i) for i in range(shape.num_layers)]


def head_cost(shape, layout: Layout) -> float:
    """The output head's forward + backward FLOPs per microbatch on one rank (the last block)."""
    return 3 * 2 * shape.hidden_size * shape.vocab_size * layout.micro_batch_size * \
        layout.seq_length / layout.cp / layout.tp


def min_max_split(costs: list[float], blocks: int, last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers per block (contiguous, >= 1 each) minimising the heaviest block's cost; ties go to
    the split with the most even counts. `last_extra`: a cost the last block carries besides its
    layers."""
    n = len(costs)
    if not 1 <= blocks <= n:
        raise ValueError(f"{blocks} pipeline blocks for {n} layers: every block needs a layer")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the heaviest block when the first j layers form k blocks; cut[k][j]: the start
    # of the k-th block there
    best = [[inf] * (n + 1) for _ in range(blocks + 1)]
    cut = [[0] * (n + 1) for _ in range(blocks + 1)]
    best[0][0] = 0.0
    for k in range(1, blocks + 1):
        extra = last_extra if k == blocks else 0.0
        for j in range(k, n - (blocks - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i] + extra)
                if value < best[k][j] * (1 - 1e-12):
                    best[k][j], cut[k][j] = value, i
    sizes, j = [], n
    for k in range(blocks, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def balanced_split(shape, layout: Layout) -> tuple[int, ...]:
    """Layers per pipeline block (pp x vpp, model order) at balanced cost for `layout`."""
    shape = hybrid.shape_of(shape)
    return min_max_split(layer_costs(shape, layout), layout.pp * layout.vpp,
                         head_cost(shape, layout))


def with_balanced_split(shape, layout: Layout) -> Layout:
    """`layout` with its pipeline split replaced by the balanced one (pp 1: unchanged)."""
    if layout.pp == 1:
        return layout
    return layout.replace(stage_layout=balanced_split(shape, layout), first_stage_layers=None,
                          last_stage_layers=None)


def proposed_split(cfg, layout: Layout) -> Layout:
    """What the planner plans: a hybrid model at pp > 1 whose layout names no split gets the
    balanced one; anything else (a transformer, a split the user gave) stays as it is."""
    from megazoo.models.hybrid_counts import is_hybrid
    par = layout.parallel
    given = par.stage_layout is not None or par.first_stage_layers is not None or \
        par.last_stage_layers is not None
    if given or not is_hybrid(cfg) or not 1 < layout.pp * layout.vpp <= cfg.num_layers:
        return layout
    return with_balanced_split(cfg, layout)


def describe_split(shape, layout: Layout) -> str:
    """One line: the balanced split as the flag, with each block's share of the FLOPs."""
    shape = hybrid.shape_of(shape)
    sizes = balanced_split(shape, layout)
    costs, start, shares = layer_costs(shape, layout), 0, []
    total = sum(costs) + head_cost(shape, layout)
    for b, n in enumerate(sizes):
        block = sum(costs[start:start + n]) + (head_cost(shape, layout) if b == len(sizes) - 1
                                                else 0.0)
        shares.append(f"{100 * block / total:.0f}%")
        start += n
    return f"{FLAG} '{format_layout(sizes)}' (FLOPs per stage: {', '.join(shares)})"
