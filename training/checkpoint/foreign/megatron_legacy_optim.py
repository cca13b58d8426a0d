"""The optimizer in Megatron-LM's legacy checkpoint files (not `--use-distributed-optimizer`, whose
state is in distrib_optim.pt: megatron_distrib_optim.py), read (`assign`) and written (`state_dict`)
for megatron_legacy.py.

It is torch's Adam state dict, inside Megatron's mixed-precision wrapper ({optimizer,
fp32_from_fp16_params, grad_scaler}) or as it is in fp32, or a list of both for the dense and
expert optimizers. Its parameter groups carry `wd_mult` and `is_expert_parallel`, which say which
of the stage's parameters (in module order) each group holds: no weight decay for biases and 1-D
tensors, and expert weights apart (files from before these keys: [weight decay, no weight decay]).
"""
from __future__ import annotations

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.reshard import FullState

STATES = ("exp_avg", "exp_avg_sq")  # Adam's moments, beside the fp32 master


def assign(params: list[tuple[str, torch.Tensor]], sd: dict, path: str):
    """key -> (Adam's state dict, fp32 master or None) of every parameter of `params` ((key,
    tensor) of a stage in module order) that the optimizer of file `path` (loaded as `sd`) holds;
    empty when the file holds no optimizer."""
    return _assign(params, _optimizers(sd, path), path)


def _group_key(key: str, t: torch.Tensor) -> tuple[float, bool]:
    """Megatron's parameter-group key: (weight-decay multiplier, expert-parallel)."""
    no_wd = key.endswith(".bias") or t.dim() == 1
    return (0.0 if no_wd else 1.0, ".mlp.experts." in key)


def _optimizers(sd: dict, path: str) -> list[tuple[dict, list | None]]:
    """[(torch optimizer state dict, fp32 masters per group or None)] of a file's optimizer."""
    opt = sd.get("optimizer")
    if opt is None:
        return []
    parts = opt if isinstance(opt, list) else [opt]
    out = []
    for part in parts:
        if "state" in part and "param_groups" in part:
            out.append((part, None))
        elif "optimizer" in part:
            out.append((part["optimizer"], part.get("fp32_from_fp16_params")))
        else:
            raise ckpt.CheckpointError(f"{path}: optimizer state of an unknown form "
                                       f"({sorted(part)[:5]}); load the weights with --finetune")
    return out


def _assign(params: list[tuple[str, torch.Tensor]], optimizers, path: str):
    """key -> (state dict of Adam, fp32 master or None) for every parameter the optimizers hold."""
    out = {}
    keyed = [(_group_key(k, t), k, t) for k, t in params]
    for opt, masters in optimizers:
        groups = opt["param_groups"]
        for g, group in enumerate(groups):
            if "wd_mult" in group:
                want = (float(group["wd_mult"]), bool(group.get("is_expert_parallel", False)))
                members = [(k, t) for key, k, t in keyed if key == want]
            else:  # Megatron before parameter-group keys: [weight decay, no weight decay]
                members = [(k, t) for key, k, t in keyed if (key[0] == 1.0) == (g == 0)]
            if len(members) != len(group["params"]):
                raise ckpt.CheckpointError(f"{path}: optimizer group {g} holds "
                                           f"{len(group['params'])} parameters, the model's "
                                           f"{len(members)}; load the weights with --finetune")
            for j, ((k, t), idx) in enumerate(zip(members, group["params"])):
                state = opt["state"].get(idx, {})
                master = masters[g][j] if masters is not None else t.float()
                for name in STATES:
                    if name in state and state[name].shape != t.shape:
                        raise ckpt.CheckpointError(f"{path}: {name} of {k} has shape "
                                                   f"{tuple(state[name].shape)}, the weight "
                                                   f"{tuple(t.shape)}; load with --finetune")
                out[k] = (state, master)
    return out


def state_dict(params, full: FullState, config, part, step: int) -> dict:
    """Torch Adam's state dict as Megatron-LM saves it (in its mixed-precision wrapper unless
    fp32), parameters grouped by (weight-decay multiplier, expert) in first-seen order."""
    groups, order = {}, []
    for m, z, s, e in params:
        local = part(full.weights, z, s, e)
        key = _group_key(m.split(":", 1)[-1], local)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((z, s, e))
    state, param_groups, masters, idx = {}, [], [], 0
    for key in order:
        ids = []
        masters.append([])
        for z, s, e in groups[key]:
            state[idx] = {"step": torch.tensor(float(step)),
                          **{n: part(full.optim[n], z, s, e).float() for n in STATES}}
            masters[-1].append(part(full.optim["master"], z, s, e).float())
            ids.append(idx)
            idx += 1
        param_groups.append(dict(params=ids, wd_mult=key[0], lr_mult=1.0,
                                 is_expert_parallel=key[1], is_decoupled_lr=False, lr=0.0,
                                 weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, amsgrad=False))
    adam = {"state": state, "param_groups": param_groups}
    if config.params_dtype == "float32":
        return adam
    return {"optimizer": adam, "fp32_from_fp16_params": masters}
