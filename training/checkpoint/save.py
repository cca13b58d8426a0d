"""Save everything a run needs to continue exactly where it stopped (resume.py reads it back).

Per rank: the model chunks' parameters (this rank's shards), the optimizer's state dict (its
ZeRO shards, loss scaler, step counters) and the RNG streams; in the metadata: the iteration,
the consumed-samples count (the data position), the layout, the model configuration (its
family among the fields), which optimizer state it holds (optimizer_record.py) and where each
rank file's slices are (slices.py). Each rank file also holds its parameter table
(param_table.py), so any other layout can read it (reshard.py).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from megazoo.parallel import collectives as C
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint import slices
from megazoo.training.checkpoint import storage
from megazoo.training.checkpoint.layout_record import layout_record
from megazoo.training.checkpoint.optimizer_record import optimizer_record
from megazoo.training.checkpoint.param_table import PARAMS, param_table, table_json
from megazoo.training.config.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def layout_of(run: RunConfig, topo) -> dict:
    """The layout this run's checkpoints record (layout_record.py)."""
    return layout_record(topo.config, dp=topo.dp, zero_stage=run.optimizer.zero_stage)


def rank_tensors(chunks, opt, rng, zero_stage: int) -> dict[str, torch.Tensor]:
    """What one rank's checkpoint file holds (tools/dry_run.py sizes it on meta tensors)."""
    tensors = {f"optim.{k}": v for k, v in opt.state_dict().items()}
    tensors[PARAMS] = ckpt.json_tensor(table_json(param_table(chunks, opt, frozen=True)))
    tensors.update({f"rng.{k}": v for k, v in rng.get_states().items()})
    for c, chunk in enumerate(chunks):
        # under ZeRO-3 the weights live in the optimizer's shards only; frozen parameters (the
        # router's expert bias) are outside the optimizer, so they are saved here at any stage
        tensors.update({f"model.{c}.{n}": p for n, p in chunk.named_parameters()
                        if zero_stage < 3 or not p.requires_grad})
    return tensors


def ranges_rows(opt) -> list[list[int]]:
    """This rank's ZeRO `ranges` rows over every bucket (param index, start, end, offset)."""
    return [row for k, v in opt.state_dict().items() if k.endswith(".ranges") for row in v.tolist()]


def slices_record(chunks, opt, topo, zero_stage: int) -> dict:
    """Collective: meta.json's record of every rank file's slices (`slices.py`; ZeRO-0 shards
    hold whole tensors, so no ranges). Each rank's description travels as JSON bytes padded to
    the longest (two all-gathers)."""
    ranges = ranges_rows(opt) if zero_stage > 0 else []
    mine = ckpt.json_tensor(slices.file_record(param_table(chunks, opt, frozen=True), ranges,
                                               topo.pp_rank))
    group = C.world()
    if C.is_single(group):
        return slices.meta_record([ckpt.tensor_json(mine)])
    device = C.collective_device(group)
    sizes = C.all_gather(torch.tensor([mine.numel()], device=device), group).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:mine.numel()] = mine
    every = C.all_gather(padded.to(device), group).cpu().reshape(len(sizes), -1)
    return slices.meta_record([ckpt.tensor_json(row[:n].clone()) for row, n in zip(every, sizes)])


def save(run: RunConfig, topo, chunks, opt, rng, state: TrainState, writer=None) -> str:
    """Collective: this rank's part of the checkpoint of `state.iteration`, then retention.
    With `writer` (an `AsyncCheckpointWriter`, --async-save) the files are written in the
    background and retention runs once they are committed; returns the checkpoint's folder."""
    meta = dict(consumed_samples=state.consumed_samples, skipped_steps=state.skipped_steps,
                model=dataclasses.asdict(run.model), layout=layout_of(run, topo),
                seq_length=run.data.seq_length, seed=run.seed,
                optimizer=optimizer_record(run.optimizer),
                slices=slices_record(chunks, opt, topo, run.optimizer.zero_stage))
    if run.lora is not None:  # what export needs to write PEFT's adapter_config.json or merge
        meta["lora"] = run.lora.record()
    root = run.checkpoint.save
    tensors = rank_tensors(chunks, opt, rng, run.optimizer.zero_stage)
    if topo.rank == 0:  # before the save's free-space check: --keep-last can make room
        storage.make_room(root, ckpt.candidates(root), sum(t.numel() * t.element_size()
                          for t in tensors.values()), topo.world_size, run.checkpoint.keep_last,
                          run.checkpoint.keep_every)

    def prune() -> None:
        if topo.rank == 0:
            storage.prune(ckpt.candidates(root), run.checkpoint.keep_last, run.checkpoint.keep_every)

    if writer is not None:
        return writer.start(root, state.iteration, tensors, meta, on_commit=prune)
    folder = ckpt.save_checkpoint(root, state.iteration, topo.rank, topo.world_size, tensors, meta,
                                  device=topo.device)
    prune()
    return folder
