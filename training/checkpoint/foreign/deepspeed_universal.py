"""megazoo checkpoints out as DeepSpeed universal checkpoints (Megatron-DeepSpeed's GPT / BLOOM
pipeline module), the layout DeepSpeed's universal loader reads (`--universal-checkpoint`,
deepspeed/checkpoint/universal_checkpoint.py and ZeROOptimizer's
load_hp_checkpoint_state_from_checkpoint_dir):

    ROOT/latest_universal                         "global_stepN"
    ROOT/global_stepN/zero/<param>/fp32.pt        {"param": whole fp32 master, "cat_dim": d,
                                                   "vocab_tensor": True for the embedding}
    ROOT/global_stepN/zero/<param>/exp_avg.pt, exp_avg_sq.pt    the Adam moments, same form
    ROOT/global_stepN/zero/<param>/step.pt        the Adam step
    ROOT/global_stepN/zero/optimizer_state.pt     the optimizer's global state and its two
                                                   parameter groups (weight decay, none)
    ROOT/global_stepN/mp_rank_00_model_states.pt  args, iteration, steps and samples
    ROOT/global_stepN/layer_XX-model_00-model_states.pt   each pipeline layer's weights

Parameters are whole with the vocabulary padding cut (the loader pads to its own TP size and
cuts each rank's part along `cat_dim`: 0 for column-parallel tensors, 1 for row-parallel
weights, none for copies), named as Megatron-DeepSpeed's pipeline module names them (layer 1
the tied embedding, 3.. the blocks, blocks + 4 the final norm). A universal checkpoint carries
no layout: DeepSpeed loads it at any TP, PP and DP size.
"""
from __future__ import annotations

import logging
import os

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import megatron_args
from megazoo.training.checkpoint.foreign.deepspeed import BLOCK, EMBEDDING, FINAL, pipeline_numbers
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

LATEST = "latest_universal"
_STATES = {"master": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}
_CAT_DIM = {"column": 0, "vocab": 0, "row": 1}
# the optimizer state's scalars DeepSpeed's ZeRO-1/2 `_load_global_state` reads
_GLOBAL_STATE = {"dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.0,
                 "ds_version": "0.16.0"}


def _pipeline_entries(full: dict, layers: int) -> list[tuple[int, str, str, str]]:
    """[(pipeline layer number, key in that layer, canonical name, split)] of every weight."""
    embed, first_block, final = pipeline_numbers(layers)
    by_canon = {z: (m, s) for m, (z, s) in EMBEDDING.items()}
    out = [(embed, m, z, s) for z, (m, s) in by_canon.items() if z in full]
    for i in range(layers):
        out += [(first_block + i, m, f"layers.{i}.{z}", s) for m, (z, s) in BLOCK.items()
                if f"layers.{i}.{z}" in full]
    out += [(final, m, z, s) for m, (z, s) in FINAL.items() if z in full]
    return out


def _check(full: FullState, config, tp: int, pp: int, vpp: int, where: str) -> None:
    if (tp, pp, vpp) != (1, 1, 1):
        raise ckpt.CheckpointError(f"--tp/--pp/--vpp {tp}/{pp}/{vpp}: a universal checkpoint has "
                                   f"no layout (DeepSpeed loads it at any); export without them")
    if not full.optim:
        raise ckpt.CheckpointError(f"{where}: holds no optimizer state; a universal checkpoint "
                                   f"is the fp32 masters and Adam moments (save with optimizer)")
    if not config.tie_word_embeddings or config.gated_mlp or config.num_experts:
        raise ckpt.CheckpointError(f"{where}: only Megatron-DeepSpeed's GPT and BLOOM pipeline "
                                   f"models (tied head, GELU MLP, no experts) have universal "
                                   f"names; export --format megatron or hf instead")


def write(full: FullState, config, root: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
          iteration: int = 0) -> str:
    """A megazoo FullState (with its optimizer) as a DeepSpeed universal checkpoint."""
    _check(full, config, tp, pp, vpp, root)
    layers = config.num_layers
    entries = _pipeline_entries(full.weights, layers)
    names = {z for _, _, z, _ in entries}
    if names != set(full.weights):
        raise ckpt.CheckpointError(f"{root}: {sorted(set(full.weights) - names)[:3]} have no "
                                   f"Megatron-DeepSpeed pipeline name")
    folder = os.path.join(root, f"global_step{iteration}")
    zero = os.path.join(folder, "zero")
    step = int(full.scalars.get("applied_steps", torch.tensor(iteration)))
    layer_files: dict[int, dict] = {}
    for number, key, canon, split in entries:
        name = (f"tied_modules.embed.{key}" if key in EMBEDDING else f"{number}.{key}")
        os.makedirs(os.path.join(zero, name), exist_ok=True)
        extra = {"cat_dim": _CAT_DIM[split]} if split in _CAT_DIM else {}
        if split == "vocab":
            extra["vocab_tensor"] = True
        for state, file in _STATES.items():
            torch.save({"param": full.optim[state][canon].float().contiguous(), **extra},
                       os.path.join(zero, name, file))
        torch.save(torch.tensor(float(step)), os.path.join(zero, name, "step.pt"))
        weight = full.weights[canon].to(config.dtype)
        if split == "vocab":  # the pipeline layer holds the padded vocabulary
            pad = config.padded_vocab_size(1) - weight.shape[0]
            weight = torch.cat([weight, weight.new_zeros((pad,) + tuple(weight.shape[1:]))])
        layer_files.setdefault(number, {})[key] = weight.contiguous()
    # the loader copies a group's entries over the running optimizer's (lr, weight decay):
    # none are written, so the resumed run's own settings stand
    torch.save({**_GLOBAL_STATE, "param_groups": [{"params": []}, {"params": []}]},
               os.path.join(zero, "optimizer_state.pt"))
    for number, sd in layer_files.items():
        torch.save(sd, os.path.join(folder, f"layer_{number:02d}-model_00-model_states.pt"))
    consumed = int(full.meta.get("consumed_samples", 0) or 0)
    args = megatron_args.from_config(config, tp=1, pp=1, vpp=1, iteration=iteration,
                                     consumed_samples=consumed,
                                     seq_length=full.meta.get("seq_length"),
                                     megatron_deepspeed=True)
    args.deepspeed, args.universal_checkpoint = True, True
    torch.save({"module": None, "args": args, "iteration": iteration, "global_steps": iteration,
                "global_samples": consumed, "skipped_steps": max(iteration - step, 0),
                "dp_world_size": 1, "mp_world_size": 1, "ds_version": _GLOBAL_STATE["ds_version"],
                "checkpoint_version": 3.0}, os.path.join(folder, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(f"global_step{iteration}")
    logger.info("wrote DeepSpeed universal checkpoint %s (%d parameters, iteration %d, step %d)",
                folder, len(entries), iteration, step)
    return folder
