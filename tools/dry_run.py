"""Dry-run a training layout at full scale on one CPU: the real code, no GPU, no weights.

For each chosen rank, on PyTorch's fake process group of the full world size (every collective
returns at once, as torchtitan's dry run does): the topology and its process groups, the rank's
real model chunks and ZeRO optimizer on the `meta` device (shapes only: no memory, no init
compute), and one training step's pipeline schedule through the real engine on meta tensors
(forward, backward, gradient reduce-scatter). It prints, per rank, what that rank holds and would
write, next to the planner's prediction (training/planner.py).

    # BLOOM-176B as trained: 384 ranks, the first, last and a middle pipeline rank
    python tools/dry_run.py --model bloom-176b --world-size 384 --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 12 --decoder-first-pipeline-num-layers 5 \\
        --decoder-last-pipeline-num-layers 5 --zero-stage 1 --bf16 --recompute-granularity full \\
        --micro-batch-size 2 --global-batch-size 2048 --seq-length 2048 --ranks first,last,200

Flags are the training scripts' (training/arguments.py) plus `--world-size`, `--rank R` /
`--ranks all|positions|stages|first,last,R,...` and `--arch`. Not run: the optimizer step itself
(its gradient-norm check and loss-scale logic read values on the host, which meta tensors lack).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.hf import FAMILIES, model_class  # noqa: E402
from parallel.layout import Grid  # noqa: E402
from parallel.pipeline.engine import PipelineStats, SavedBytes, run_pipeline  # noqa: E402
from parallel.pipeline.schedules import activation_bound, build_schedule  # noqa: E402
from parallel.random import model_parallel_seed  # noqa: E402
from parallel.topology import ParallelTopology  # noqa: E402
from parallel.zero.optimizer import build_optimizer  # noqa: E402
from training import planner  # noqa: E402
from training.arguments import ArgumentError, build_parser, to_run_config  # noqa: E402
from training.checkpointing import rank_file  # noqa: E402
from training.loop import build_chunks  # noqa: E402
from training.reshard import param_table  # noqa: E402
from training.resume import rank_tensors  # noqa: E402
from training.step import activation_shape, make_forward_fn  # noqa: E402

META = torch.device("meta")
FAMILY_BY_POSITIONS = {"learned": "gpt2", "alibi": "bloom", "rope": "llama"}


@dataclass
class RankReport:
    rank: int
    coords: tuple  # (pp, dp, cp, tp)
    chunks: list  # (chunk, first layer, stop layer, pre_process, post_process)
    numel: int  # parameters this rank holds
    distinct: dict  # canonical tensor name -> full (unsharded, unpadded) numel, as held
    buckets: list  # (numel, padded numel, shard numel) per ZeRO bucket
    memory: dict  # optimizer.memory_report()
    predicted_states: tuple  # planner: (weights, gradients, optimizer) bytes
    microbatches: int  # per step (m); `run_microbatches` of them went through the engine
    run_microbatches: int
    activation_units: int  # most (microbatch, chunk) pairs the engine kept alive
    activation_bound: int  # the schedule's bound for this rank (parallel/pipeline/schedules.py)
    activation_bytes: int  # most bytes autograd kept (engine) + one layer's under recompute
    predicted_activations: float  # planner
    checkpoint: dict  # file name, tensors, bytes
    groups: dict  # kind -> list of global ranks
    inconsistent: list  # groups some member sees differently (none expected)
    seconds: dict = field(default_factory=dict)  # groups / build / step


# ---- the fake world ----------------------------------------------------------------------------

@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """This process as `rank` of a fake world: collectives return at once, on CPU and meta."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without torch.distributed initialised")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank,
                            world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_provider(run, arch: str | None):
    """The model class the training script of this architecture builds."""
    name = arch or FAMILY_BY_POSITIONS[run.model.position_embedding]
    cls = model_class(FAMILIES[name])

    def provide(config, topo, **kwargs):
        return cls(config, topo, **kwargs)
    return provide


def planner_layout(run, dp: int) -> planner.Layout:
    """The planner's view of a run: the same layout, batch and precision (SDPA: flash)."""
    opt, p = run.optimizer, run.parallel
    return planner.Layout(
        tp=p.tp, pp=p.pp, dp=dp, vpp=p.vpp, zero=opt.zero_stage,
        sequence_parallel=p.sequence_parallel and p.tp > 1,
        recompute="full" if run.model.recompute_layers else "none",
        micro_batch=run.schedule.micro_batch_size, global_batch=run.schedule.global_batch_size,
        seq_length=run.data.seq_length, precision=opt.precision,
        grad_bytes=torch.empty((), dtype=opt.grad_torch_dtype).element_size(),
        flash_attention=True, first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers)


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


def inconsistent_groups(grid: Grid, groups: dict) -> list[str]:
    """Groups (as the topology built them) that some member would see differently: each member's
    own groups are derived from its coordinates alone (`Grid.groups_of`), another code path."""
    return [f"{kind} {ranks}: rank {m} sees {grid.groups_of(m)[kind]}"
            for kind, ranks in groups.items() for m in ranks if grid.groups_of(m)[kind] != ranks]


# ---- one rank ----------------------------------------------------------------------------------

def _distinct(chunks, topo) -> dict:
    """Full numel of each distinct tensor this rank holds a part of, counted where the whole
    model counts it: TP-replicated tensors on TP rank 0, a tied head copy not at all."""
    out = {}
    for _, name, canonical, shape, dim, full, _ in param_table(chunks):
        if canonical != name and name.endswith("head_weight"):
            continue  # the last stage's copy of the tied word embedding
        if dim < 0 and topo.tp_rank != 0:
            continue
        numel = 1
        for i, n in enumerate(shape):
            numel *= full if i == dim else n
        out[canonical] = numel
    return out


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Size of the safetensors file `tensors` make: 8-byte length, JSON header padded to 8
    bytes, then the data (the format's specification; checked against a real file in tests)."""
    import json
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {}, 0
    for k in names:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    text = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + -(-text // 8) * 8 + offset


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
                       torch.bool: "BOOL", torch.float64: "F64"}


def dry_run_rank(run, world_size: int, rank: int, provider, step_microbatches: int | None = None,
                 step: bool = True) -> RankReport:
    """Build and step `rank` of the run on a fake world; see the module docstring."""
    seconds = {}
    with fake_world(world_size, rank), torch.random.fork_rng(devices=[]):
        t = time.perf_counter()
        topo = ParallelTopology.from_config(run.parallel)
        seconds["groups"] = time.perf_counter() - t
        topo.device = META
        t = time.perf_counter()
        rng = model_parallel_seed(run.seed, topo)
        with torch.device(META):
            chunks = build_chunks(provider, run, topo, rng)
            opt = build_optimizer(chunks, topo, run.optimizer)
        seconds["build"] = time.perf_counter() - t
        layout = planner_layout(run, topo.dp)
        m = layout.microbatches
        schedule = run.schedule.pipeline_schedule if topo.pp > 1 else "no_pipelining"
        bound = activation_bound(schedule, topo.pp, topo.pp_rank, m, topo.vpp)
        n = step_microbatches or _microbatches_to_peak(schedule, topo, m, bound)
        stats = PipelineStats()
        t = time.perf_counter()
        working = 0
        if step:
            _one_step(run, topo, chunks, opt, schedule, n, stats)
            working = _recompute_working_bytes(run, topo, chunks)
        seconds["step"] = time.perf_counter() - t
        tensors = rank_tensors(chunks, opt, rng, run.optimizer.zero_stage)
        stage = planner.stage_name(topo.pp_rank, topo.pp)
        predicted = planner.model_state_bytes(
            planner.stage_params(run.model, topo.tp, topo.pp, stage,
                                 layers=planner.rank_layers(run.model, layout, topo.pp_rank)),
            layout)
        return RankReport(
            rank=rank, coords=tuple(topo.coords),
            chunks=[(i, *c.layer_range, c.pre_process, c.post_process) for i, c in enumerate(chunks)],
            numel=opt.numel, distinct=_distinct(chunks, topo),
            buckets=[(b.numel, b.padded, b.shard_numel) for b in opt.buffers],
            memory=opt.memory_report(), predicted_states=predicted, microbatches=m,
            run_microbatches=n if step else 0, activation_units=stats.peak_activations,
            activation_bound=bound, activation_bytes=stats.peak_saved_bytes + working,
            predicted_activations=planner.activation_bytes(run.model, layout, stage,
                                                           pp_rank=topo.pp_rank),
            checkpoint=dict(file=os.path.basename(rank_file("", rank)), tensors=len(tensors),
                            bytes=safetensors_bytes(tensors)),
            groups=dict(topo.group_ranks), inconsistent=inconsistent_groups(topo.grid,
                                                                            topo.group_ranks),
            seconds=seconds)


def _microbatches_to_peak(schedule: str, topo, m: int, bound: int) -> int:
    """The fewest microbatches whose schedule reaches the full step's activation peak on this
    rank (a multiple of pp when interleaved); more only repeat the steady state."""
    step = topo.pp if schedule == "interleaved" else 1
    for n in range(step, m, step):
        if activation_bound(schedule, topo.pp, topo.pp_rank, n, topo.vpp) == bound:
            return n
    return m


class _FusedAttentionShapes(torch.autograd.Function):
    """What a fused attention kernel (FlashAttention on GPUs, SDPA's flash kernel on CPUs) keeps
    for backward: q, k, v (GQA's fewer key/value heads as they are), its output, the fp32
    log-sum-exp of each row, and the additive mask when there is one (ALiBi). On meta tensors
    SDPA takes its math path, which would keep fp32 copies and the attention scores instead."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _DropoutShapes(torch.autograd.Function):
    """Dropout keeps a 1-byte mask on CPUs and GPUs; on meta it would keep one in the input's
    dtype."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


@contextlib.contextmanager
def _fused_attention_on_meta():
    """Meta-tensor attention and dropout keep what the device kernels keep (forward and
    recompute): `_FusedAttentionShapes`, `_DropoutShapes`."""
    sdpa, dropout = F.scaled_dot_product_attention, F.dropout

    def attention(q, k, v, attn_mask=None, **kwargs):
        if q.is_meta:
            return _FusedAttentionShapes.apply(q, k, v, attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    def drop(x, p=0.5, training=True, inplace=False):
        if x.is_meta and training and p > 0:
            return _DropoutShapes.apply(x)
        return dropout(x, p, training, inplace)
    F.scaled_dot_product_attention, F.dropout = attention, drop
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout


def _recompute_working_bytes(run, topo, chunks) -> int:
    """Under full recompute, what one layer saves while its backward recomputes it (the
    engine sees only the checkpointed inputs): one layer's forward, uncheckpointed, counted."""
    if not run.model.recompute_layers:
        return 0
    layer = next(layer for c in chunks for layer in c.layers.values())
    x = torch.empty(activation_shape(topo, run.data.seq_length, run.schedule.micro_batch_size,
                                     run.model.hidden_size), dtype=run.model.dtype, device=META)
    counter = SavedBytes(chunks)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), \
            _fused_attention_on_meta():
        layer(x.requires_grad_())
    return counter.total


def _one_step(run, topo, chunks, opt, schedule: str, n: int, stats: PipelineStats) -> None:
    """training/step.py's forward_backward on meta microbatches, up to the gradient
    reduction (its loss average reads a value on the host, which a meta tensor has not)."""
    mbs, seq = run.schedule.micro_batch_size, run.data.seq_length
    ids = torch.empty((mbs, seq), dtype=torch.long, device=META)
    microbatches = [{"tokens": ids, "labels": ids} for _ in range(n)]
    steps = build_schedule(schedule, topo.pp, topo.pp_rank, n, vpp=len(chunks))
    with opt.no_sync(), _fused_attention_on_meta():
        run_pipeline(steps, chunks, microbatches, topo,
                     activation_shape(topo, seq, mbs, run.model.hidden_size),
                     opt.cfg.model_dtype, make_forward_fn(opt.loss_scale), stats=stats)
    opt.grad_sync.launch_remaining()
    opt.grad_sync.finish()


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

def parse(argv=None):
    p = build_parser()
    g = p.add_argument_group("dry run")
    g.add_argument("--world-size", type=int, required=True, help="ranks of the run to rehearse")
    g.add_argument("--rank", type=int, help="one rank (same as --ranks R)")
    g.add_argument("--ranks", default="first,last",
                   help="all | positions (one per (pp, tp)) | stages (one per pipeline stage) | "
                        "a list of ranks, 'first', 'last'")
    g.add_argument("--arch", choices=sorted(FAMILIES),
                   help="model family (default: from the position embedding)")
    g.add_argument("--step-microbatches", type=int,
                   help="microbatches through the engine (default: the fewest that reach the "
                        "schedule's activation peak on the rank)")
    g.add_argument("--no-step", action="store_true", help="build only; skip the training step")
    p.set_defaults(train_iters=1, mock_data=True)
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    try:
        run = to_run_config(args, world_size=args.world_size)
    except (ArgumentError, ValueError) as e:
        p.error(str(e))
    return args, run


def main(argv=None) -> list[RankReport]:
    args, run = parse(argv)
    grid = run.parallel.grid(args.world_size)
    try:
        ranks = chosen_ranks(str(args.rank) if args.rank is not None else args.ranks, grid)
    except ArgumentError as e:
        sys.exit(f"error: {e}")
    provider = model_provider(run, args.arch)
    reports = []
    for rank in ranks:
        reports.append(dry_run_rank(run, args.world_size, rank, provider, args.step_microbatches,
                                    step=not args.no_step))
        print(rank_text(reports[-1]), flush=True)
    print(summary_text(run, reports, grid))
    return reports


if __name__ == "__main__":
    main()
