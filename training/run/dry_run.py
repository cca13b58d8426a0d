"""The dry run of one rank (tools/dry_run.py is its command line): the rank on a fake process
group of the full world, its topology, model chunks and ZeRO optimizer on the `meta` device and
one training step's schedule through the real engine, reported beside the planner's prediction.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazoo.parallel.layout import Grid
from megazoo.parallel.pipeline.engine import PipelineStats, SavedBytes, run_pipeline
from megazoo.parallel.pipeline.schedules import activation_bound, build_schedule
from megazoo.parallel.random import model_parallel_seed
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero.optimizer import build_optimizer

from megazoo.training.planning import planner
from megazoo.training.checkpoint.format import rank_file
from megazoo.training.run.loop import build_chunks
from megazoo.training.planning.meta_kernels import balanced_routing, device_kernels_on_meta
from megazoo.training.checkpoint.param_table import param_table
from megazoo.training.checkpoint.save import rank_tensors
from megazoo.training.run.step import activation_shape, make_forward_fn

META = torch.device("meta")


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


def inconsistent_groups(grid: Grid, groups: dict) -> list[str]:
    """Groups (as the topology built them) that some member would see differently: each member's
    own groups are derived from its coordinates alone (`Grid.groups_of`), another code path."""
    return [f"{kind} {ranks}: rank {m} sees {grid.groups_of(m)[kind]}"
            for kind, ranks in groups.items() for m in ranks if grid.groups_of(m)[kind] != ranks]


# ---- one rank ----------------------------------------------------------------------------------

def _distinct(chunks, topo) -> dict:
    """Full numel of each distinct tensor this rank holds a part of, counted where the whole
    model counts it: TP-replicated tensors on TP rank 0, a tied head copy not at all, a MoE
    layer's stacked experts as all `ep` ranks' of them."""
    out = {}
    for row in param_table(chunks):
        name, canonical, shape, dim, full = row.name, row.canonical, row.shape, row.tp_dim, row.full_size
        if canonical != name and name.endswith("head_weight"):
            continue  # the last stage's copy of the tied word embedding
        if dim < 0 and topo.tp_rank != 0:
            continue
        numel = 1
        for i, n in enumerate(shape):
            numel *= full if i == dim else n * (topo.ep if row.expert and i == 0 else 1)
        out[canonical] = numel
    return out


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Size of the safetensors file `tensors` make: 8-byte length, JSON header padded to 8
    bytes, then the data (the format's specification; checked against a real file in tests)."""
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
        t = time.perf_counter()
        rng = model_parallel_seed(run.seed, topo)  # on the CPU: meta tensors draw no numbers
        topo.device = META
        with torch.device(META):
            chunks = build_chunks(provider, run, topo, rng)
            opt = build_optimizer(chunks, topo, run.optimizer, run.model.dtype)
        seconds["build"] = time.perf_counter() - t
        layout = planner.Layout.of_run(run, topo.dp)
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
        predicted = planner.rank_state_bytes(run.model, layout, topo.pp_rank)
        return RankReport(
            rank=rank, coords=tuple(topo.coords),
            chunks=[(i, *c.layer_range, c.pre_process, c.post_process)
                    for i, c in enumerate(chunks)],
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


def _recompute_working_bytes(run, topo, chunks) -> int:
    """Under full recompute, what one checkpointed unit saves while its backward recomputes it
    (the engine sees only the units' inputs): the largest unit's forward, uncheckpointed,
    counted (a rank's layers differ: DeepSeek-V3's dense first layers and MoE layers)."""
    cfg = run.model
    if cfg.recompute_granularity != "full":
        return 0
    unit = cfg.recompute_num_layers if cfg.recompute_method == "uniform" else 1
    layers = [layer for c in chunks for layer in c.layers.values()]
    shape = activation_shape(topo, run.data.seq_length, run.schedule.micro_batch_size,
                             run.model.hidden_size)
    most = 0
    for first in range(0, len(layers), unit):
        x = torch.empty(shape, dtype=run.model.dtype, device=META)
        counter = SavedBytes(chunks)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), \
                device_kernels_on_meta(), balanced_routing(chunks):
            x.requires_grad_()
            for layer in layers[first:first + unit]:
                x = layer(x)
        most = max(most, counter.total)
    return most


def _one_step(run, topo, chunks, opt, schedule: str, n: int, stats: PipelineStats) -> None:
    """training/run/step.py's forward_backward on meta microbatches, up to the gradient
    reduction (its loss average reads a value on the host, which a meta tensor has not)."""
    mbs, seq = run.schedule.micro_batch_size, run.data.seq_length
    ids = torch.empty((mbs, seq), dtype=torch.long, device=META)
    microbatches = [{"tokens": ids, "labels": ids} for _ in range(n)]
    steps = build_schedule(schedule, topo.pp, topo.pp_rank, n, vpp=len(chunks))
    with opt.no_sync(), device_kernels_on_meta(), balanced_routing(chunks):
        run_pipeline(steps, chunks, microbatches, topo,
                     activation_shape(topo, seq, mbs, run.model.hidden_size),
                     opt.dtype, make_forward_fn(opt.loss_scale), stats=stats)
    opt.grad_sync.launch_remaining()
    opt.grad_sync.finish()
