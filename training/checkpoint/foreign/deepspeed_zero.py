"""DeepSpeed ZeRO-1/2/3 checkpoints as engine.save_checkpoint writes them (read by deepspeed.py's
`read` when a global_step folder holds `*_optim_states.pt` files).

A ZeRO checkpoint, as DeepSpeed's engine.save_checkpoint writes it, has one
`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per data-parallel rank (`bf16_` with bf16
training) and the engine's records (`param_shapes`, steps, samples) in
`mp_rank_00_model_states.pt` (ZeRO-1/2) or in one `zero_pp_rank_R_mp_rank_00_model_states.pt`
per rank (ZeRO-3, whose `module` holds empty placeholders). The optimizer files keep each
parameter group's fp32 masters and Adam moments flat: ZeRO-1/2 split the group's concatenated
parameters over the ranks (`single_partition_of_fp32_groups`, padding removed), ZeRO-3 splits
every parameter into ceil(numel / ranks) pieces (`fp32_flat_groups`). The fp32 masters are
read whatever the training dtype. Its names are the trained module's, so a Hugging Face model's
config.json (`--hf-config`) gives the model and the names; a ZeRO checkpoint records no
configuration of its own (as universal checkpoints under its names: deepspeed_universal_hf.py).

Checked against DeepSpeed 0.19.8's own files (tests/training/test_checkpoint_deepspeed_engine.py):
one or two parameter groups (the Hugging Face Trainer's weight decay / no decay split), 2 and 3
ranks (uneven partitions, each group's flat buffer padded at its end), tied and untied
embeddings, a Qwen2-MoE model, fp32, bf16 and fp16, ZeRO-3 sub-groups, PEFT LoRA, and the
Trainer's `checkpoint-N/global_stepN` layout, whose config.json beside `latest` stands in for
--hf-config.
Parameters outside the optimizer (`frozen_param_shapes`: requires_grad False) have no master
nor moments: such a run imports weights only (--no-optimizer), those from the model-state files.
A PEFT model's run (every parameter named `base_model.model.*`: the adapters alone in the
optimizer) imports as a megazoo LoRA run instead (deepspeed_peft.py); fp16 runs carry their
dynamic loss scale over (deepspeed_loss_scale.py).
"""
from __future__ import annotations

import logging
import math
import os
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import deepspeed_loss_scale, deepspeed_peft, safe_load
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

_STEP = re.compile(r"global_step(\d+)")
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def optim_files(folder: str) -> list[str]:
    found = []
    for name in os.listdir(folder):
        m = _OPTIM_FILE.fullmatch(name)
        if m:
            if int(m[2]) != 0:
                raise ckpt.CheckpointError(f"{folder}: {name} is a model-parallel rank's ZeRO "
                                           f"state; convert it with ds_to_universal.py first")
            found.append((int(m[1]), os.path.join(folder, name)))
    return [p for _, p in sorted(found)]


def _zero_model_states(folder: str) -> str:
    """The engine's records (param_shapes, steps, samples): ZeRO-1/2's one file, or rank 0's of
    ZeRO-3's per-rank files (the same records on every rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise ckpt.CheckpointError(f"{folder}: neither mp_rank_00_model_states.pt (ZeRO-1/2) nor "
                               f"zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3) is there; "
                               f"copy the model-state files with the optimizer's")


def value(v):
    return getattr(v, "value", v)


def _group_states(osd: dict, stage: int, groups: int) -> list[dict]:
    """Per parameter group, this rank's flat Adam state ({exp_avg, exp_avg_sq, step})."""
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    if isinstance(base, list):  # ZeRO-1/2's elastic form: one lean state per group
        return base
    state = (base or {}).get("state", {})
    return [state.get(g, {}) for g in range(groups)]


def _check_groups(shapes, groups: int, where: str) -> None:
    if len(shapes) != groups:
        raise ckpt.CheckpointError(f"{where}: param_shapes records {len(shapes)} parameter groups, "
                                   f"the optimizer files {groups}; the files disagree")


def _unflatten_zero12(flats: list[torch.Tensor], shapes, paddings, world: int, where: str) -> dict:
    """Each group's flat buffer (every rank's piece joined): its parameters in order, each
    followed by its alignment padding, the buffer's end padded to a multiple of 2 x ranks."""
    _check_groups(shapes, len(flats), where)
    out, align = {}, 2 * world
    for g, (names, flat) in enumerate(zip(shapes, flats)):
        offset = 0
        for j, (name, shape) in enumerate(names.items()):
            n = math.prod(shape)
            if offset + n > flat.numel():
                raise ckpt.CheckpointError(f"{where}: group {g} holds {flat.numel()} elements, "
                                           f"its param_shapes need more; the files disagree")
            out[name] = flat[offset:offset + n].view(tuple(shape))
            offset += n + (paddings[g][j] if paddings else 0)
        if -(-offset // align) != -(-flat.numel() // align):
            raise ckpt.CheckpointError(f"{where}: group {g} holds {flat.numel()} elements, its "
                                       f"param_shapes account for {offset}; the files disagree")
    return out


def _unflatten_zero3(per_rank: list[torch.Tensor], shapes, where: str) -> dict:
    """Every parameter split in ceil(numel / ranks) pieces, one per rank, in param_shapes' order
    over all (sub-)groups."""
    world, out, offset = len(per_rank), {}, 0
    for name, shape in ((k, v) for names in shapes for k, v in names.items()):
        n = math.prod(shape)
        part = -(-n // world)
        full = torch.cat([flat[offset:offset + part] for flat in per_rank])
        if full.numel() < n:
            raise ckpt.CheckpointError(f"{where}: the ranks' fp32_flat_groups end before {name}")
        out[name] = full[:n].view(tuple(shape))
        offset += part
    if offset != per_rank[0].numel():
        raise ckpt.CheckpointError(f"{where}: each rank's fp32_flat_groups hold "
                                   f"{per_rank[0].numel()} elements, param_shapes account for "
                                   f"{offset}; the files disagree")
    return out


def _frozen_weights(folder: str, states: dict, stage: int, world: int) -> dict:
    """The parameters outside the optimizer, from the model-state records: whole in ZeRO-1/2's
    one file, split in ceil(numel / ranks) pieces over ZeRO-3's per-rank files."""
    shapes = states["frozen_param_shapes"]
    if stage < 3:
        pieces = [states.get("frozen_param_fragments") or {}]
    else:
        pieces = [(safe_load.load(os.path.join(
            folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")).get("frozen_param_fragments")
            or {}) for r in range(world)]
    out = {}
    for name, shape in shapes.items():
        if any(name not in p for p in pieces):
            raise ckpt.CheckpointError(f"{folder}: the model-state files record the frozen "
                                       f"parameter {name} without its frozen_param_fragments")
        whole = torch.cat([p[name].reshape(-1) for p in pieces])
        out[name] = whole[:math.prod(shape)].view(tuple(shape))
    return out


def trainer_config(folder: str) -> str | None:
    """The folder holding config.json beside `latest` (the Hugging Face Trainer saves the model's
    config in checkpoint-N/ next to DeepSpeed's global_stepN/), if any."""
    parent = os.path.dirname(os.path.abspath(folder))
    return parent if os.path.isfile(os.path.join(parent, "config.json")) else None


def read(folder: str, optimizer: bool, hf_config: str | None):
    path = _zero_model_states(folder)
    states = safe_load.load(path)
    shapes = states.get("param_shapes")
    if not shapes:
        raise ckpt.CheckpointError(f"{path} records no param_shapes; it is not a ZeRO checkpoint")
    shapes = shapes if isinstance(shapes, list) else [shapes]
    peft = deepspeed_peft.is_peft(n for names in shapes for n in names)
    if peft:  # the adapters of a PEFT model: the base from --hf-config or the frozen records
        hf_config = deepspeed_peft.base_folder(folder, hf_config, shapes[0])
    elif not hf_config:
        hf_config = trainer_config(folder)
        if not hf_config:
            raise ckpt.CheckpointError(f"{folder}: a DeepSpeed ZeRO checkpoint records no model "
                                       f"configuration; pass --hf-config with the model's "
                                       f"config.json folder")
        logger.info("%s: no --hf-config; using %s/config.json beside it (the Hugging Face "
                    "Trainer's checkpoint folder)", folder, hf_config)
    from megazoo.training.checkpoint.hf import read_hf_config
    model_type, module, hf = read_hf_config(hf_config)
    config = module.config_from_hf(hf)
    lora = deepspeed_peft.lora_record(folder, config, shapes[0]) if peft else None
    frozen = states.get("frozen_param_shapes") or {}
    if frozen and optimizer and not peft:  # DeepSpeed's "frozen": not in the optimizer
        raise ckpt.CheckpointError(
            f"{path}: {len(frozen)} parameters were not trained (frozen_param_shapes, e.g. "
            f"{next(iter(frozen))}), so they have no fp32 master nor Adam moments; import the "
            f"weights alone with --no-optimizer and train from them with --finetune")
    osds = [safe_load.load(p)["optimizer_state_dict"] for p in optim_files(folder)]
    stage = int(value(osds[0].get("zero_stage", 0)))
    count = osds[0].get("partition_count")
    world = max(count) if isinstance(count, list) else int(count or len(osds))
    if world != len(osds):
        raise ckpt.CheckpointError(f"{folder}: {len(osds)} *_optim_states.pt files, the ZeRO "
                                   f"partition count is {world}; copy every rank's file")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = len(osds[0][key])
    per_state = {"master": [o[key] for o in osds]}
    if optimizer:
        for s in ("exp_avg", "exp_avg_sq"):
            per_state[s] = [[st[s] for st in _group_states(o, stage, groups)] for o in osds]
    full, world_frozen = {}, None
    if frozen:
        world_frozen = _frozen_weights(folder, states, stage, world)
    for state, ranks in per_state.items():
        if stage == 3:
            flat = _unflatten_zero3([torch.cat(list(r)) for r in ranks], shapes, folder)
        else:
            merged = [torch.cat([r[g] for r in ranks]) for g in range(groups)]
            flat = _unflatten_zero12(merged, shapes, osds[0].get("param_alignment_paddings"),
                                     world, folder)
        if peft:
            full[state] = deepspeed_peft.adapters(flat, config, lora, folder)
            continue
        if frozen:  # weights only (refused above with the optimizer)
            flat.update(world_frozen)
        try:
            full[state] = {k: v.float() for k, v in module.from_hf_state_dict(flat, config).items()}
        except KeyError as e:
            raise ckpt.CheckpointError(
                f"{folder}: the parameters lack {e}; they do not match {hf_config}/config.json "
                f"({model_type}), or the run saved with exclude_frozen_parameters=True: its "
                f"frozen parameters are in no file; import a save that kept them") from None
    steps = {int(st["step"]) for o in osds for st in _group_states(o, stage, groups) if "step" in st}
    named = _STEP.fullmatch(os.path.basename(os.path.normpath(folder)))
    iteration = int(states.get("global_steps") or (named[1] if named else 0))
    step = max(steps) if steps else iteration
    meta = dict(consumed_samples=int(states.get("global_samples") or 0),
                skipped_steps=int(states.get("skipped_steps") or 0),
                source=dict(format=f"deepspeed-zero{stage}", folder=os.path.abspath(folder)))
    weights = dict(full["master"])
    if peft:
        weights.update(deepspeed_peft.base_weights(hf_config, module, config, world_frozen, folder))
        meta["lora"] = lora
    optim = full if optimizer else {}
    scalars = {"iteration": torch.tensor(iteration), "applied_steps": torch.tensor(step),
               **deepspeed_loss_scale.scaler_scalars(osds[0], folder)} if optimizer else {}
    return model_type, config, FullState(meta, weights, optim, scalars), iteration
