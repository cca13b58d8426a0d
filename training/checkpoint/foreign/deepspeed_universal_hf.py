"""DeepSpeed universal checkpoints of a Hugging Face module in (`--format deepspeed --hf-config`).

A `transformers` model trained under `deepspeed.initialize` and converted by DeepSpeed's
ds_to_universal.py (or exported by megazoo with `--universal-names hf`) holds every parameter
whole under the module's own names:

    ROOT/latest_universal (or latest)            "global_stepN"
    ROOT/global_stepN/zero/<HF name>/fp32.pt     the fp32 master: {"param": tensor, ...}, or the
                                                 bare flat tensor (ds_to_universal.py of ZeRO-3;
                                                 shaped by the records' `param_shapes`)
    ROOT/global_stepN/zero/<HF name>/exp_avg.pt, exp_avg_sq.pt    the Adam moments, same forms
    ROOT/global_stepN/zero/<HF name>/step.pt     the Adam step (ZeRO-1/2; ZeRO-3 keeps it in
                                                 zero/optimizer_state.pt's optimizer_state_dict)
    ROOT/global_stepN/*model_states.pt           the engine's records: global_steps, samples

The names are mapped by the Hugging Face family of `--hf-config`'s config.json.
"""
from __future__ import annotations

import math
import os

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import safe_load
from megazoo.training.checkpoint.reshard import FullState

_STATES = {"master": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}
_RECORDS = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def is_hf_named(zero: str) -> bool:
    """Whether a universal checkpoint's `zero/` names its parameters as a Hugging Face module
    (not as Megatron-DeepSpeed's pipeline module: `tied_modules.embed.*`, `{layer}.*`)."""
    names = [n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))]
    return bool(names) and not any(n.startswith("tied_modules.") or n.split(".", 1)[0].isdigit()
                                   for n in names)


def _tensor(path: str) -> torch.Tensor:
    if not os.path.isfile(path):
        raise ckpt.CheckpointError(f"{path} is missing; the universal checkpoint is incomplete "
                                   f"(or import with --no-optimizer)")
    record = safe_load.load(path)
    tensor = record.get("param") if isinstance(record, dict) else record
    if not isinstance(tensor, torch.Tensor):
        raise ckpt.CheckpointError(f"{path}: holds no 'param' tensor")
    return tensor


def _shapes(states: dict) -> dict:
    groups = states.get("param_shapes") or []
    out = {}
    for group in groups if isinstance(groups, list) else [groups]:
        out.update({k: tuple(v) for k, v in group.items()})
    return out


def _shaped(tensor: torch.Tensor, shape, zero: str, name: str) -> torch.Tensor:
    """ds_to_universal.py of ZeRO-3 saves each state flat; `param_shapes` gives the shape."""
    if shape is None or tuple(tensor.shape) == shape:
        return tensor
    if tensor.numel() != math.prod(shape):
        raise ckpt.CheckpointError(f"{zero}/{name}: {tensor.numel()} elements, param_shapes "
                                   f"records {shape}; the files disagree")
    return tensor.reshape(shape)


def _step(folder: str, names: list[str]) -> int | None:
    steps = {int(safe_load.load(os.path.join(folder, "zero", n, "step.pt")))
             for n in names if os.path.isfile(os.path.join(folder, "zero", n, "step.pt"))}
    if steps:
        return max(steps)
    path = os.path.join(folder, "zero", "optimizer_state.pt")
    if os.path.isfile(path):
        state = (safe_load.load(path).get("optimizer_state_dict") or {}).get("state") or {}
        if state and "step" in state.get(0, {}):
            return int(state[0]["step"])
    return None


def read(folder: str, optimizer: bool, hf_config: str | None):
    """(family, config, FullState, iteration) of a Hugging Face module's universal checkpoint."""
    if not hf_config:
        raise ckpt.CheckpointError(f"{folder}/zero holds a Hugging Face module's parameters and "
                                   f"no model configuration; pass --hf-config with the model's "
                                   f"config.json folder")
    from megazoo.training.checkpoint.hf import read_hf_config
    model_type, module, hf = read_hf_config(hf_config)
    config = module.config_from_hf(hf)
    zero = os.path.join(folder, "zero")
    names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    records = [os.path.join(folder, n) for n in _RECORDS if os.path.isfile(os.path.join(folder, n))]
    states = safe_load.load(records[0]) if records else {}
    shapes = _shapes(states)
    wanted = _STATES if optimizer else {"master": "fp32.pt"}
    full = {}
    for state, file in wanted.items():
        sd = {n: _shaped(_tensor(os.path.join(zero, n, file)), shapes.get(n), zero, n)
              for n in names}
        try:
            full[state] = {k: v.float() for k, v in module.from_hf_state_dict(sd, config).items()}
        except KeyError as e:
            raise ckpt.CheckpointError(f"{zero}: the parameters lack {e}; they do not match "
                                       f"{hf_config}/config.json ({model_type})") from None
    tag = os.path.basename(folder).removeprefix("global_step")
    iteration = int(states.get("global_steps") or (int(tag) if tag.isdigit() else 0))
    step = _step(folder, names)
    step = iteration if step is None else step
    meta = dict(consumed_samples=int(states.get("global_samples") or 0),
                skipped_steps=int(states.get("skipped_steps") or 0),
                source=dict(format="deepspeed-universal-hf", folder=os.path.abspath(folder)))
    scalars = {"iteration": torch.tensor(iteration), "applied_steps": torch.tensor(step)} \
        if optimizer else {}
    return (model_type, config, FullState(meta, dict(full["master"]), full if optimizer else {},
                                          scalars), iteration)
