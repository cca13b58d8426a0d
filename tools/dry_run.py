"""Dry-run a training layout at full scale on one CPU: the real code, no GPU, no weights.

For each chosen rank, on PyTorch's fake process group of the full world size (every collective
returns at once, as torchtitan's dry run does): the topology and its process groups, the rank's
real model chunks and ZeRO optimizer on the `meta` device (shapes only: no memory, no init
compute), and one training step's pipeline schedule through the real engine on meta tensors
(forward, backward, gradient reduce-scatter). It prints, per rank, what that rank holds and would
write, next to the planner's prediction (training/planning/planner.py).

    # BLOOM-176B as trained: 384 ranks, the first, last and a middle pipeline rank
    python tools/dry_run.py --model bloom-176b --world-size 384 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 12 --decoder-first-pipeline-num-layers 5 \\
        --decoder-last-pipeline-num-layers 5 --zero-stage 1 --bf16 --recompute-granularity full \\
        --micro-batch-size 2 --global-batch-size 2048 --seq-length 2048 --ranks first,last,200

Flags are the training scripts' (training/config/flags.py) plus `--world-size`, `--rank R` /
`--ranks all|positions|stages|first,last,R,...` and `--arch`. Not run: the optimizer step itself
(its gradient-norm check and loss-scale logic read values on the host, which meta tensors lack).
The dry run of one rank is `training/run/dry_run.py`; docs/planner.md has the published layouts'.
"""
from __future__ import annotations

import dataclasses
import sys

from megazoo.models.presets import PRESETS
from megazoo.models.registry import FAMILIES, build_model
from megazoo.parallel.layout import Grid
from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser
from megazoo.training.run.dry_run import RankReport, dry_run_rank, safetensors_bytes  # noqa: E402,F401

def model_provider(run, arch: str | None = None):
    """What the training scripts build: the registry's model of the config's family (`--arch`
    is applied to the config by `parse`, so `arch` is only the caller's record of it)."""
    return build_model


def chosen_ranks(spec: str, grid: Grid) -> list[int]:
    """`all`, `positions` (one rank per (pp, tp)), `stages` (one per pipeline stage), or a list
    of ranks and the words `first` (rank 0) / `last` (the last rank)."""
    world = grid.world_size
    if spec == "all":
        return list(range(world))
    if spec == "positions":
        return [grid.rank(p, 0, 0, t) for p in range(grid.pp) for t in range(grid.tp)]
    if spec == "stages":
        return [grid.rank(p, 0, 0, 0) for p in range(grid.pp)]
    out = []
    for word in spec.split(","):
        r = {"first": 0, "last": world - 1}.get(word.strip())
        if r is None:
            try:
                r = int(word)
            except ValueError:
                raise ArgumentError(f"--ranks: {word!r} is not a rank, 'first' or 'last' (or use "
                                    f"all / positions / stages)") from None
        if not 0 <= r < world:
            raise ArgumentError(f"--ranks: rank {r} is outside the world of {world} ranks")
        out.append(r)
    return list(dict.fromkeys(out))


# ---- printing ----------------------------------------------------------------------------------

def ranks_text(ranks: list[int]) -> str:
    """A group's ranks, short: `0-3`, `5:389:48 (8)` for an arithmetic progression."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return (f"{ranks[0]}-{ranks[-1]}" if step == 1
                else f"{ranks[0]}:{ranks[-1] + 1}:{step} ({len(ranks)})")
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")


def _gib(x: float) -> str:
    return f"{x / 2 ** 30:.3f} GiB"


def rank_text(r: RankReport) -> str:
    mem, (pw, pg, po) = r.memory, r.predicted_states
    held = ", ".join(f"chunk {c}: layers {a}-{b - 1}" + (" + embedding" if pre else "")
                     + (" + norm/head/loss" if post else "")
                     if b > a else f"chunk {c}: no layers" + (" + embedding" if pre else "")
                     + (" + norm/head/loss" if post else "") for c, a, b, pre, post in r.chunks)
    sizes = sorted({(n, p, s) for n, p, s in r.buckets}, reverse=True)
    buckets = ", ".join(f"{sum(1 for b in r.buckets if b == x)} x {x[0]:,} (shard {x[2]:,})"
                        for x in sizes[:4]) + (" ..." if len(sizes) > 4 else "")
    optim = mem["master_params"] + mem["optimizer_states"]
    lines = [
        f"rank {r.rank} (pp {r.coords[0]}, dp {r.coords[1]}, cp {r.coords[2]}, tp {r.coords[3]})",
        f"  holds       {held}",
        f"  parameters  {r.numel:,}",
        f"  buckets     {len(r.buckets)}: {buckets}",
        f"  states      weights {_gib(mem['params'])}, grads {_gib(mem['grads'])}, fp32 master "
        f"{_gib(mem['master_params'])}, optimizer {_gib(mem['optimizer_states'])}: "
        f"{_gib(mem['model_states'])} (planner {_gib(pw + pg + po)}: {_gib(pw)} / {_gib(pg)} / "
        f"{_gib(po)}; held - planned = {mem['params'] - pw + mem['grads'] - pg + optim - po:,.0f} "
        f"bytes of bucket padding)",
        f"  activations {_gib(r.activation_bytes)} at the peak, {r.activation_units} (microbatch, "
        f"chunk) in flight (schedule bound {r.activation_bound}; {r.run_microbatches} of "
        f"{r.microbatches} microbatches run); planner {_gib(r.predicted_activations)}",
        f"  checkpoint  {r.checkpoint['file']}: {r.checkpoint['tensors']} tensors, "
        f"{r.checkpoint['bytes']:,} bytes ({_gib(r.checkpoint['bytes'])})",
        "  groups      " + "; ".join(f"{k} {ranks_text(v)}" for k, v in r.groups.items()
                                     if len(v) > 1)
        + ("; the same on every member" if not r.inconsistent else
           f"; INCONSISTENT: {r.inconsistent[:3]}"),
        "  seconds     " + ", ".join(f"{k} {v:.2f}" for k, v in r.seconds.items()),
    ]
    return "\n".join(lines)


def summary_text(run, reports: list[RankReport], grid: Grid) -> str:
    distinct: dict = {}
    for r in reports:
        distinct.update(r.distinct)
    stages = sorted({r.coords[0] for r in reports})
    total = sum(distinct.values())
    whole = run.model.num_parameters()
    cover = ("every pipeline stage" if len(stages) == grid.pp
             else f"pipeline stages {stages} of {grid.pp}")
    return (f"{len(reports)} ranks of {grid.world_size} (tp {grid.tp} x cp {grid.cp} x dp "
            f"{grid.dp} x pp {grid.pp}); parameters held on every rank run: "
            f"{sum(r.numel for r in reports):,} (TP and DP replicas and padding included)\n"
            f"distinct parameters over {cover}: {total:,}"
            + (f" (the model: {whole:,}, {total / whole - 1:+.2e})" if len(stages) == grid.pp
               else ""))


# ---- command line ------------------------------------------------------------------------------

def dry_run_parser():
    """The training scripts' parser with the dry run's own flags."""
    p = build_parser()
    g = p.add_argument_group("dry run")
    g.add_argument("--world-size", type=int, required=True, help="ranks of the run to rehearse")
    g.add_argument("--rank", type=int, help="one rank (same as --ranks R)")
    g.add_argument("--ranks", default="first,last",
                   help="all | positions (one per (pp, tp)) | stages (one per pipeline stage) | "
                        "a list of ranks, 'first', 'last'")
    g.add_argument("--arch", choices=sorted(FAMILIES),
                   help="model family (default: the preset's, or the one the model flags make)")
    g.add_argument("--step-microbatches", type=int,
                   help="microbatches through the engine (default: the fewest that reach the "
                        "schedule's activation peak on the rank)")
    g.add_argument("--no-step", action="store_true", help="build only; skip the training step")
    g.add_argument("--cluster", default="dgx-h100-80gb",
                   help="a hybrid preset's plan: the GPUs it is planned for (tools/plan.py's "
                        "--cluster names)")
    p.set_defaults(train_iters=1, mock_data=True)
    return p


def parse(argv=None):
    p = dry_run_parser()
    try:
        args = p.parse_args(argv)
        if args.world_size < 1:
            raise ArgumentError(f"--world-size must be >= 1, got {args.world_size}")
        if args.grpo_prompts:
            raise ArgumentError("--grpo-prompts: the dry run rehearses a training step on mock data, "
                                "not GRPO's sampling; drop it (docs/post_training.md lists what "
                                "GRPO adds to the memory)")
        run = to_run_config(args, world_size=args.world_size)
        if args.arch is not None:  # refused in one line when the model flags do not fit it
            run = dataclasses.replace(run, model=run.model.replace(family=args.arch))
        return args, run
    except ValueError as e:  # ArgumentError, LayoutError: one line, as the training scripts
        _fail(str(e))


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def hybrid_main(argv: list[str], name: str):
    """A hybrid preset (Qwen3.5, Qwen3-Next, Nemotron-H) the registry does not list: its plan
    at the layout the flags give, the family model built on meta, one cp rank's forward measured
    layer by layer (training/planning/hybrid_dry_run.py); --cluster-memory-gib sizes the GPU."""
    from megazoo.training.config.layout_flags import parallel_config_of
    from megazoo.training.planning import hybrid_dry_run as H
    from megazoo.training.planning.layout import Layout
    from megazoo.training.planning.reference_runs import CLUSTERS
    try:
        args = dry_run_parser().parse_args(argv)
        if args.cluster not in CLUSTERS:
            raise ArgumentError(f"--cluster {args.cluster!r}: choose one of {sorted(CLUSTERS)}")
    except ValueError as e:
        _fail(str(e))
    config, cls = H.hybrid_preset(name)
    shape_layers = len(config.layer_types)
    try:
        parallel = parallel_config_of(args, shape_layers)
        dp = args.world_size // (parallel.tp * parallel.pp * parallel.cp)
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
        layout = Layout(parallel=parallel, dp=dp, micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch_size or args.micro_batch_size * dp,
                        seq_length=args.seq_length, params_dtype=dtype,
                        recompute_granularity=args.recompute_granularity, flash_attention=True)
        layout = layout.replace(zero_stage=args.zero_stage or 0)
        cluster = CLUSTERS[args.cluster].replace(num_gpus=args.world_size)
        report = H.dry_run(config, cls, layout, cluster)
    except ValueError as e:
        _fail(str(e))
    print(H.report_text(name, report))
    return report


def _model_flag(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def main(argv=None) -> list[RankReport]:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _model_flag(argv)
    if name is not None and name not in PRESETS:
        from megazoo.training.planning.hybrid_dry_run import hybrid_preset
        if hybrid_preset(name) is not None:
            return hybrid_main(argv, name)
    args, run = parse(argv)
    grid = run.parallel.grid(args.world_size)
    try:
        ranks = chosen_ranks(str(args.rank) if args.rank is not None else args.ranks, grid)
    except ArgumentError as e:
        _fail(str(e))
    provider = model_provider(run, args.arch)
    reports = []
    for rank in ranks:
        reports.append(dry_run_rank(run, args.world_size, rank, provider, args.step_microbatches,
                                    step=not args.no_step))
        print(rank_text(reports[-1]), flush=True)
    print(summary_text(run, reports, grid))
    return reports


def cli() -> int:
    """The console entry point: the reports are printed, the exit code is 0."""
    main()
    return 0


if __name__ == "__main__":
    main()
