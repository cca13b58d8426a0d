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

A Hugging Face model trained under `deepspeed.initialize` (the engine wraps the `transformers`
module itself) names its parameters as the module does (`model.layers.0.self_attn.q_proj.weight`):
`names="hf"` writes `zero/<HF name>/` from the family's HF adapter (tensors, and moments, as
`transformers` lays them out), `zero/optimizer_state.pt` in the form both loaders read (ZeRO-1/2:
the global state and `param_groups`; ZeRO-3: `optimizer_state_dict` with the step) and the model
state file under both names the engine looks for (`mp_rank_00_model_states.pt`, ZeRO-3's
`zero_pp_rank_0_mp_rank_00_model_states.pt`). `names="auto"` picks the pipeline names where the
model has them (tied GPT/BLOOM) and HF names otherwise, and says which.
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


NAMES = ("auto", "hf", "megatron-deepspeed")
# empty parameter groups: the ZeRO-1/2 loader pairs them with the running optimizer's groups
# (as many as it has) and copies their entries, none, so the resumed run's settings stand
_GROUPS = 16


def _has_pipeline_names(config) -> bool:
    return config.tie_word_embeddings and not config.gated_mlp and not config.num_experts


def _check(full: FullState, config, tp: int, pp: int, vpp: int, where: str, names: str) -> str:
    if (tp, pp, vpp) != (1, 1, 1):
        raise ckpt.CheckpointError(f"--tp/--pp/--vpp {tp}/{pp}/{vpp}: a universal checkpoint has "
                                   f"no layout (DeepSpeed loads it at any); export without them")
    if not full.optim:
        raise ckpt.CheckpointError(f"{where}: holds no optimizer state; a universal checkpoint "
                                   f"is the fp32 masters and Adam moments (save with optimizer)")
    if names not in NAMES:
        raise ckpt.CheckpointError(f"--universal-names {names!r}: one of {', '.join(NAMES)}")
    if names == "megatron-deepspeed" and not _has_pipeline_names(config):
        raise ckpt.CheckpointError(f"{where}: only Megatron-DeepSpeed's GPT and BLOOM pipeline "
                                   f"models (tied head, GELU MLP, no experts) have pipeline "
                                   f"names; export with --universal-names hf instead")
    if names == "auto":
        names = "megatron-deepspeed" if _has_pipeline_names(config) else "hf"
        logger.info("%s: universal parameter names: %s (--universal-names chooses)", where, names)
    return names


def _optimizer_state(step: int) -> dict:
    return {**_GLOBAL_STATE, "param_groups": [{"params": []} for _ in range(_GROUPS)],
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(step))}},
                                     "param_groups": [{"params": []}]}}


def _write_hf(full: FullState, config, root: str, iteration: int) -> str:
    """Parameters under the Hugging Face module's names (a `transformers` model run by
    deepspeed.initialize)."""
    from megazoo.models.registry import family
    adapter = family(config.family, root).adapter
    states = {s: adapter.to_hf_state_dict(full.optim[s], config) for s in _STATES}
    if config.tie_word_embeddings:  # one parameter, named once by named_parameters()
        for sd in states.values():
            sd.pop("lm_head.weight", None)
    folder = os.path.join(root, f"global_step{iteration}")
    zero = os.path.join(folder, "zero")
    step = int(full.scalars.get("applied_steps", torch.tensor(iteration)))
    for name in states["master"]:
        os.makedirs(os.path.join(zero, name), exist_ok=True)
        for state, file in _STATES.items():
            torch.save({"param": states[state][name].float().contiguous()},
                       os.path.join(zero, name, file))
        torch.save(torch.tensor(float(step)), os.path.join(zero, name, "step.pt"))
    torch.save(_optimizer_state(step), os.path.join(zero, "optimizer_state.pt"))
    consumed = int(full.meta.get("consumed_samples", 0) or 0)
    record = {"module": None, "buffer_names": [], "global_steps": iteration,
              "global_samples": consumed, "skipped_steps": max(iteration - step, 0),
              "dp_world_size": 1, "mp_world_size": 1, "lr_scheduler": None,
              "ds_version": _GLOBAL_STATE["ds_version"]}
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(record, os.path.join(folder, name))
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(f"global_step{iteration}")
    logger.info("wrote DeepSpeed universal checkpoint %s (%d parameters under Hugging Face "
                "names, iteration %d, step %d)", folder, len(states["master"]), iteration, step)
    return folder


def write(full: FullState, config, root: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
          iteration: int = 0, names: str = "auto") -> str:
    """A megazoo FullState (with its optimizer) as a DeepSpeed universal checkpoint, its
    parameters named as Megatron-DeepSpeed's pipeline module or a Hugging Face module names them."""
    if _check(full, config, tp, pp, vpp, root, names) == "hf":
        return _write_hf(full, config, root, iteration)
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
