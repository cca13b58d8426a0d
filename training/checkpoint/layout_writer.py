"""A checkpoint for a target layout written from one process: full tensors (`reshard.FullState`,
read from any layout or converted from a foreign format) sliced the way each target rank's own
chunks are sharded, one rank file per target rank (the conversion and resharding tools).

The target ranks' chunks are built on the CPU without process groups (`build_rank_chunks`) to
learn their names, shapes, TP slicing and experts; their rank files carry the same parameter
table and slice records as a trained run's (training/checkpoint/reshard.py, slices.py), so
`reshard.read_full_state` and the resume path read them like any checkpoint.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from megazoo.models.lora import apply_lora
from megazoo.models.lora_targets import LoRASettings
from megazoo.models.registry import build_model
from megazoo.parallel.param_spec import spec_of
from megazoo.parallel.sharding import local_shard
from megazoo.parallel.topology import ParallelConfig, ParallelTopology

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint import slices
from megazoo.training.checkpoint.layout_record import layout_record
from megazoo.training.checkpoint.param_table import PARAMS, param_table, table_json, table_order
from megazoo.training.checkpoint.reshard import FullState


def build_rank_chunks(config, parallel: ParallelConfig | None = None, *, dp: int = 1,
                      rank: int = 0, lora: dict | None = None, **sizes):
    """One rank's model chunks at `parallel` (or its `sizes`; none: unsharded) x `dp`, built on
    the CPU without process groups (to learn their names, shapes, TP slicing and experts); with
    `lora` (a checkpoint's record) their adapters too."""
    parallel = ParallelConfig.of(parallel, **sizes)
    topo = ParallelTopology(config=parallel, rank=rank,
                            world_size=parallel.tp * parallel.pp * parallel.cp * dp, dp=dp)
    topo.group_ranks = topo.grid.groups_of(rank)
    specs = topo.config.chunk_specs(config.num_layers, topo.pp_rank)
    chunks = [build_model(config, topo, **spec.kwargs()) for spec in specs]
    if lora is not None:  # the adapters trained, the base frozen, as the run that wrote them
        apply_lora(chunks, LoRASettings.from_record(lora), config, topo, None, 0)
    return topo, chunks


def write_layout(full: FullState, root: str, *, config, parallel: ParallelConfig | None = None,
                 dp: int = 1, zero_stage: int = 0, iteration: int = 0, meta: dict | None = None,
                 weights_only: bool = False, **sizes) -> str:
    """Write `full` as a checkpoint for the target layout (`parallel`, or its `sizes` such as
    tp=2, x `dp` data-parallel ranks), one file per target rank.

    Optimizer states go into one bucket per rank whose `ranges` split every parameter evenly over
    the data x context parallel ranks (ZeRO's group; all of it on each rank for ZeRO-0); loading
    re-slices them into the live optimizer's buckets.
    """
    parallel = ParallelConfig.of(parallel, **sizes)
    world = parallel.tp * parallel.pp * parallel.cp * dp
    parallel.validate(world)
    config.check_layout(parallel)
    with_optim = bool(full.optim) and not weights_only
    tmp = ckpt.begin_offline(root, iteration)
    records = []
    for rank in range(world):
        topo, chunks = build_rank_chunks(config, parallel, dp=dp, rank=rank,
                                         lora=(meta or full.meta).get("lora"))
        rows = param_table(chunks, frozen=True)
        named = [p for *_, p in table_order(chunks)]
        tensors = {PARAMS: ckpt.json_tensor(table_json(rows))}
        ranges = []
        for row, p in zip(rows, named):
            c, n, canon = row.chunk, row.name, row.canonical
            if canon not in full.weights:
                raise ckpt.CheckpointError(f"the source lacks {canon}; it is another model")
            local = local_shard(p, full.weights[canon], topo)
            if local.shape != p.shape:
                raise ckpt.CheckpointError(f"{canon}: shape {tuple(full.weights[canon].shape)} does "
                                           f"not fit this model; the source is another model")
            # (frozen parameters keep their own dtype: the expert bias is fp32 in any model)
            tensors[f"model.{c}.{n}"] = local.to(config.dtype if p.requires_grad else p.dtype)
        if with_optim:
            flats = defaultdict(list)
            offset = 0
            for idx, (row, p) in enumerate(zip(rows, named)):
                if row.frozen:
                    continue  # weights only: no optimizer state
                canon, numel = row.canonical, p.numel()
                group = topo.group_ranks["edp" if spec_of(p).expert else "dp_cp"]
                per = -(-numel // len(group)) if zero_stage > 0 else numel
                lo = group.index(rank) * per if zero_stage > 0 else 0
                hi = min(numel, lo + per)
                if hi <= lo:
                    continue
                ranges.append([idx, lo, hi, offset])
                offset += hi - lo
                for state, values in full.optim.items():
                    flats[state].append(local_shard(p, values[canon].float(), topo).reshape(-1)[lo:hi])
            tensors["optim.bucket0.ranges"] = torch.tensor(ranges, dtype=torch.int64).reshape(-1, 4)
            tensors.update({f"optim.bucket0.{s}": torch.cat(v) for s, v in flats.items()})
            tensors.update({f"optim.{k}": v for k, v in full.scalars.items()})
        ckpt.write_rank_file(tmp, rank, tensors)
        records.append(slices.file_record(rows, ranges if zero_stage > 0 else [], topo.pp_rank))
        del chunks
    # (older checkpoints' top-level "family" was the class that wrote them: the model config's
    # family field replaces it)
    base = {k: v for k, v in (meta or full.meta).items()
            if k not in ("layout", "model", "iteration", "world_size", "files", "family", "slices")}
    base["slices"] = slices.meta_record(records)
    base.update(model=dataclasses.asdict(config),
                layout=layout_record(parallel, dp=dp, zero_stage=zero_stage))
    if not with_optim:
        base["weights_only"] = True
    return ckpt.commit(root, iteration, world, base)
