"""Restore what save.py wrote, so a run continues exactly where it stopped: the same layout
shard by shard, any other through full tensors (reshard.py).
"""
from __future__ import annotations

import logging

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.optimizer_record import check_optimizer_record
from megazoo.training.checkpoint.param_table import param_table
from megazoo.training.checkpoint import reshard
from megazoo.training.checkpoint.lora_load import without_absent_adapters
from megazoo.training.checkpoint import slices
from megazoo.training.checkpoint.save import TrainState, layout_of, ranges_rows
from megazoo.training.config.run_config import RunConfig

logger = logging.getLogger(__name__)


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
    rows = param_table(chunks, frozen=True)
    need = slices.need_of(rows, topo.tp_rank, topo.tp, ranges_rows(opt))
    names = without_absent_adapters(meta, {row.canonical for row in rows}, need)
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
