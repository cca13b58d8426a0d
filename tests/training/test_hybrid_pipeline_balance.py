"""The planner's pipeline split for hybrid models (training/planning/hybrid_balance.py): layers
weighed by their kind's FLOPs, cut into the pp x vpp blocks whose heaviest block is lightest,
proposed as --pipeline-model-parallel-layout; the layout search and tools/plan.py take hybrid
presets at any pipeline size. Library calls only."""
from __future__ import annotations

import itertools
import random

from megazoo.models.presets import preset
from megazoo.parallel.pipeline.layer_layout import parse_layout
from megazoo.training.planning import hybrid
from megazoo.training.planning.hybrid_balance import (balanced_split, head_cost, layer_costs,
                                                      min_max_split, proposed_split)
from megazoo.training.planning.layout import Layout
from megazoo.training.planning.reference_runs import CLUSTERS

# a Nemotron-H whose first half is Mamba-2 layers and second half attention + MLP pairs: an
# even split by count puts the expensive kinds on the last stages
SKEWED = "M" * 12 + "*-" * 6


def _skewed():
    mixer = {"M": "mamba2", "*": "attention", "-": "none"}
    mlp = {"M": "none", "*": "none", "-": "dense"}
    return preset("nemotron-h-8b", num_layers=len(SKEWED),
                  token_mixers=tuple(mixer[c] for c in SKEWED),
                  layer_mlps=tuple(mlp[c] for c in SKEWED))


def _layout(**sizes):
    return Layout.of(tp=sizes.pop("tp", 4), micro_batch_size=1, global_batch_size=64,
                     seq_length=4096, **sizes)


def test_min_max_split_is_exact():
    rng = random.Random(0)
    for _ in range(30):
        n, k = rng.randint(2, 8), rng.randint(1, 4)
        if k > n:
            continue
        costs, extra = [rng.uniform(0.1, 5) for _ in range(n)], rng.uniform(0, 3)
        def heaviest(sizes):
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return max(sum(costs[s:s + m]) + (extra if i == len(sizes) - 1 else 0)
                       for i, (s, m) in enumerate(zip(starts, sizes)))
        every = [c for c in itertools.product(range(1, n + 1), repeat=k) if sum(c) == n]
        got = min_max_split(costs, k, extra)
        assert sum(got) == n and min(got) >= 1
        assert abs(heaviest(got) - min(map(heaviest, every))) < 1e-9


def test_balanced_split_beats_the_even_split_of_mixed_kinds():
    cfg = _skewed()
    shape = hybrid.shape_of(cfg)
    cluster = CLUSTERS["dgx-h100-80gb"].replace(num_gpus=16)
    for pp, vpp in ((4, 1), (2, 2)):
        even = _layout(pp=pp, vpp=vpp, dp=16 // 4 // pp)
        split = balanced_split(cfg, even)
        costs, head = layer_costs(shape, even), head_cost(shape, even)
        def heaviest(sizes):
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return max(sum(costs[s:s + m]) + (head if i == len(sizes) - 1 else 0)
                       for i, (s, m) in enumerate(zip(starts, sizes)))
        blocks = pp * vpp
        assert sum(split) == cfg.num_layers and len(split) == blocks
        assert split[0] > split[-1]  # cheap Mamba-2 layers first: more of them per stage
        assert heaviest(split) < 0.9 * heaviest([cfg.num_layers // blocks] * blocks)
        balanced = proposed_split(cfg, even)
        assert balanced.parallel.stage_layout == split
        assert hybrid.plan(cfg, balanced, cluster).time.total < \
            hybrid.plan(cfg, even, cluster).time.total
    # a transformer, or a split the user gave, stays as it is
    dense = _layout(pp=2, dp=2)
    assert proposed_split(preset("qwen3-tiny"), dense) == dense
    given = _layout(pp=2, dp=2, stage_layout=(12, 12))
    assert proposed_split(cfg, given) == given


def test_layout_search_and_plan_cli_take_hybrid_presets(capsys):
    from megazoo.training.config.layout_flags import layout_argv
    from megazoo.training.planning.planner import rank_layouts
    cfg = _skewed()
    cluster = CLUSTERS["dgx-h100-80gb"].replace(num_gpus=16)
    plans = rank_layouts(cfg, cluster, _layout(), dict(
        tp=4, zero_stage=1, recompute_granularity="full", micro_batch_size=1,
        sequence_parallel=True, vpp=1))
    by_pp = {p.layout.pp: p.layout for p in plans}
    assert set(by_pp) == {1, 2, 4}  # 24 layers split at any pp, not only where they divide
    for pp, lay in by_pp.items():
        if pp > 1:
            assert lay.parallel.stage_layout == balanced_split(cfg, lay)
            argv = layout_argv(lay.parallel)
            text = argv[argv.index("--pipeline-model-parallel-layout") + 1]
            assert parse_layout(text) == lay.parallel.stage_layout
    from megazoo.tools.plan import main
    main(["--model", "nemotron-h-56b", "--world-size", "64", "--tp", "8", "--pp", "4",
          "--zero-stage", "1", "--recompute", "none", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert "--pipeline-model-parallel-layout 'Et*30|t*30|t*30|t*28L'" in out
