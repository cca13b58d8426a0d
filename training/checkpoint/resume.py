"""Save and restore everything a run needs to continue exactly where it stopped.

Per rank: the model chunks' parameters (this rank's shards), the optimizer's state dict (its
ZeRO shards, loss scaler, step counters) and the RNG streams; in the metadata: the iteration,
the consumed-samples count (the data position), the layout, the model configuration (its
family among the fields), which optimizer state it holds (optimizer_record.py). Each rank file
also holds its parameter table, so any other layout can read it (reshard.py).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from megazoo.parallel import collectives as C
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.optimizer_record import check_optimizer_record, optimizer_record
from megazoo.training.checkpoint import reshard
from megazoo.training.checkpoint.lora_load import without_absent_adapters
from megazoo.training.checkpoint import slices
from megazoo.training.checkpoint import storage
from megazoo.training.config.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def layout_of(run: RunConfig, topo) -> dict:
    """The layout a checkpoint records. Dimensions added later are recorded only when used, so
    older checkpoints of the same layout still compare equal."""
    layout = dict(tp=topo.tp, pp=topo.pp, dp=topo.dp, vpp=topo.vpp, world_size=topo.world_size,
                  zero_stage=run.optimizer.zero_stage)
    c = topo.config
    layout.update({k: v for k, v in dict(cp=c.cp, ep=c.ep).items() if v != 1})
    layout.update({k: v for k, v in dict(first_stage_layers=c.first_stage_layers,
                                         last_stage_layers=c.last_stage_layers).items()
                   if v is not None})
    return layout


def rank_tensors(chunks, opt, rng, zero_stage: int) -> dict[str, torch.Tensor]:
    """What one rank's checkpoint file holds (tools/dry_run.py sizes it on meta tensors)."""
    tensors = {f"optim.{k}": v for k, v in opt.state_dict().items()}
    tensors[reshard.PARAMS] = ckpt.json_tensor(reshard.param_table(chunks, opt, frozen=True))
    tensors.update({f"rng.{k}": v for k, v in rng.get_states().items()})
    for c, chunk in enumerate(chunks):
        # under ZeRO-3 the weights live in the optimizer's shards only; frozen parameters (the
        # router's expert bias) are outside the optimizer, so they are saved here at any stage
        tensors.update({f"model.{c}.{n}": p for n, p in chunk.named_parameters()
                        if zero_stage < 3 or not p.requires_grad})
    return tensors


def _ranges_rows(opt) -> list[list[int]]:
    """This rank's ZeRO `ranges` rows over every bucket (param index, start, end, offset)."""
    return [row for k, v in opt.state_dict().items() if k.endswith(".ranges") for row in v.tolist()]


def slices_record(chunks, opt, topo, zero_stage: int) -> dict:
    """Collective: meta.json's record of every rank file's slices (`slices.py`; ZeRO-0 shards
    hold whole tensors, so no ranges). Each rank's description travels as JSON bytes padded to
    the longest (two all-gathers)."""
    ranges = _ranges_rows(opt) if zero_stage > 0 else []
    mine = ckpt.json_tensor(slices.file_record(reshard.param_table(chunks, opt, frozen=True), ranges,
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


def _same_buckets(tensors: dict, opt) -> bool:
    """Whether this rank's file holds exactly the optimizer shards this optimizer would write."""
    live = {k: v for k, v in opt.state_dict().items() if k.endswith(".ranges")}
    saved = {k[len("optim."):]: v for k, v in tensors.items()
             if k.startswith("optim.bucket") and k.endswith(".ranges")}
    return live.keys() == saved.keys() and all(torch.equal(live[k], saved[k]) for k in live)


def load(run: RunConfig, topo, chunks, opt, rng) -> TrainState:
    """Resume (or, with --finetune, take the weights only) from --load.

    A checkpoint of the same layout loads shard by shard. Any other layout (tp, pp, vpp, dp,
    ZeRO stage, bucket size), an imported model, or --finetune goes through full tensors
    (`training/checkpoint/reshard.py`); RNG streams are restored only with the same layout. Every tensor
    read is verified against its checksum; when any rank finds damage, all ranks fall back to
    the next older complete checkpoint (logged), and only a verified one is applied.
    """
    folders = ckpt.candidates(run.checkpoint.load)
    if not folders:
        if ckpt.latest_checkpoint(run.checkpoint.load) is None and topo.rank == 0:
            # (latest_checkpoint raises on a dangling 'latest')
            logger.warning("--load %s holds no checkpoint yet ('latest' missing); starting from "
                           "scratch", run.checkpoint.load)
        return TrainState()
    failures = []
    for folder in folders:
        error = None
        try:
            meta, source = _read(run, topo, chunks, opt, folder)
        except ckpt.IntegrityError as e:
            error = str(e)
            logger.error("%s", error)
        if ckpt.all_ranks_ok(error is None, topo.device):
            break
        failures.append(f"{folder}: {error or 'damaged on another rank'}")
        logger.warning("checkpoint %s does not verify; trying the next older one", folder)
    else:
        raise ckpt.CheckpointError(f"no checkpoint under {run.checkpoint.load} verifies ("
                                   f"{'; '.join(failures)}); restore one from a backup or start "
                                   f"without --load")
    if failures and topo.rank == 0:
        logger.warning("fell back to %s: %d newer checkpoint(s) failed verification", folder,
                       len(failures))
    return _apply(run, topo, chunks, opt, rng, folder, meta, source)


def check_lora(saved: dict | None, lora, folder: str) -> None:
    """A checkpoint's LoRA adapters load only into a run with the same adapters (dropout aside)."""
    if saved is None:
        return
    if lora is None:
        raise ckpt.CheckpointError(
            f"{folder} holds LoRA adapters (rank {saved['rank']} on {','.join(saved['targets'])}): "
            f"add --lora-rank {saved['rank']} --lora-alpha {saved['alpha']:g} --lora-target-modules "
            f"{','.join(saved['targets'])}, or export it merged (tools/convert_hf.py export "
            f"--merge-lora) and import that")
    mine = {k: v for k, v in lora.record().items() if k != "dropout"}
    theirs = {k: saved.get(k) for k in mine}
    if mine != theirs:
        raise ckpt.CheckpointError(f"{folder} holds LoRA adapters {theirs}; this run asks for "
                                   f"{mine}: give the checkpoint's --lora-* flags")


def _read(run: RunConfig, topo, chunks, opt, folder: str):
    """(meta, what to load) of one checkpoint, every tensor read verified; nothing applied."""
    meta = ckpt.read_resumable_meta(folder)
    finetune = run.checkpoint.finetune
    weights_only = finetune or not run.checkpoint.load_optim  # --no-load-optim keeps the progress
    saved_seq = meta.get("seq_length")
    if not finetune and saved_seq is not None and saved_seq != run.data.seq_length:
        # (before the model check: a shorter --seq-length often comes with fewer positions)
        raise ckpt.CheckpointError(
            f"--seq-length {run.data.seq_length} differs from {saved_seq} in {folder}: the saved "
            f"data position counts {saved_seq}-token samples; pass --seq-length {saved_seq}, or "
            f"--finetune to start a new data stream from these weights")
    ckpt.check_compatible(meta, model=run.model, folder=folder)
    if not weights_only:
        check_optimizer_record(meta, run.optimizer, folder)
    check_lora(meta.get("lora"), run.lora, folder)
    if run.lora is not None and meta.get("lora") is None and not weights_only:
        raise ckpt.CheckpointError(f"{folder} holds no LoRA adapters (nor their optimizer state): "
                                   f"start LoRA from it with --finetune")
    same_layout = meta.get("layout") == layout_of(run, topo)
    tensors = ckpt.load_rank_tensors(folder, topo.rank) if same_layout else {}
    if same_layout and not weights_only and _same_buckets(tensors, opt):
        return meta, tensors
    if meta.get("weights_only") and not weights_only:
        raise ckpt.CheckpointError(f"{folder} holds weights only (an imported model); add "
                                   f"--finetune to start training from it")
    rows = reshard.param_table(chunks, frozen=True)
    need = slices.need_of(rows, topo.tp_rank, topo.tp, _ranges_rows(opt))
    names = without_absent_adapters(meta, {row[2] for row in rows}, need)
    return meta, (tensors, reshard.read_full_state(folder, names, need=need))


def _apply(run: RunConfig, topo, chunks, opt, rng, folder: str, meta: dict, source) -> TrainState:
    finetune = run.checkpoint.finetune
    weights_only = finetune or not run.checkpoint.load_optim
    if isinstance(source, dict):
        tensors = source
        with torch.no_grad():
            for c, chunk in enumerate(chunks):
                for n, p in chunk.named_parameters():
                    key = f"model.{c}.{n}"
                    if key in tensors:
                        p.copy_(tensors[key])
        opt.load_state_dict({k[len("optim."):]: v for k, v in tensors.items()
                             if k.startswith("optim.")})
    else:
        tensors, full = source
        logger.info("loading %s (layout %s) into layout %s through full tensors%s", folder,
                    meta.get("layout"), layout_of(run, topo), " (weights only)" if weights_only else "")
        # (frozen parameters, such as the router's expert bias, come back through the table too)
        reshard.load_into(full, chunks, opt, topo, weights_only=weights_only, folder=folder)
    if finetune:
        logger.info("fine-tuning from %s: weights only, iteration and optimizer reset", folder)
        return TrainState()
    rng_states = {k[len("rng."):]: v for k, v in tensors.items() if k.startswith("rng.")}
    if not run.checkpoint.load_rng:
        logger.info("RNG streams not restored (--no-load-rng): seeded from --seed")
    elif rng_states:
        rng.set_states(rng_states)
    else:
        logger.info("RNG streams not restored: the checkpoint's layout differs from this run's")
    logger.info("resumed from %s at iteration %d", folder, meta["iteration"])
    return TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0))
