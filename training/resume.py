"""Save and restore everything a run needs to continue exactly where it stopped.

Per rank: the model chunks' parameters (this rank's shards), the optimizer's state dict (its
ZeRO shards, loss scaler, step counters) and the RNG streams; in the metadata: the iteration,
the consumed-samples count (the data position), the layout and the model configuration.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from . import checkpointing as ckpt
from .config import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def layout_of(run: RunConfig, topo) -> dict:
    return dict(tp=topo.tp, pp=topo.pp, dp=topo.dp, vpp=topo.vpp, world_size=topo.world_size,
                zero_stage=run.optimizer.zero_stage)


def _rank_tensors(chunks, opt, rng, zero_stage: int) -> dict[str, torch.Tensor]:
    tensors = {f"optim.{k}": v for k, v in opt.state_dict().items()}
    tensors.update({f"rng.{k}": v for k, v in rng.get_states().items()})
    if zero_stage < 3:  # under ZeRO-3 the weights live in the optimizer's shards only
        for c, chunk in enumerate(chunks):
            tensors.update({f"model.{c}.{n}": p for n, p in chunk.named_parameters()})
    return tensors


def save(run: RunConfig, topo, chunks, opt, rng, state: TrainState) -> str:
    meta = dict(consumed_samples=state.consumed_samples, skipped_steps=state.skipped_steps,
                model=dataclasses.asdict(run.model), layout=layout_of(run, topo),
                seq_length=run.data.seq_length, seed=run.seed)
    return ckpt.save_checkpoint(run.checkpoint.save, state.iteration, topo.rank, topo.world_size,
                                _rank_tensors(chunks, opt, rng, run.optimizer.zero_stage), meta)


def load(run: RunConfig, topo, chunks, opt, rng) -> TrainState:
    folder = ckpt.latest_checkpoint(run.checkpoint.load)
    if folder is None:
        logger.warning("--load %s holds no checkpoint yet ('latest' missing); starting from scratch",
                       run.checkpoint.load)
        return TrainState()
    meta = ckpt.read_meta(folder)
    ckpt.check_compatible(meta, model=dataclasses.asdict(run.model), layout=layout_of(run, topo),
                          folder=folder)
    tensors = ckpt.load_rank_tensors(folder, topo.rank)
    with torch.no_grad():
        for c, chunk in enumerate(chunks):
            for n, p in chunk.named_parameters():
                key = f"model.{c}.{n}"
                if key in tensors:
                    p.copy_(tensors[key])
    if run.checkpoint.finetune:
        logger.info("fine-tuning from %s: weights only, iteration and optimizer reset", folder)
        return TrainState()
    opt.load_state_dict({k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")})
    rng.set_states({k[len("rng."):]: v for k, v in tensors.items() if k.startswith("rng.")})
    logger.info("resumed from %s at iteration %d", folder, meta["iteration"])
    return TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0))
