"""The Hugging Face Trainer's `optimizer.pt` read back onto parameter names (hf_trainer.py).

`optimizer.pt` is torch's AdamW `state_dict()`: `param_groups` (the hyperparameters and each
group's integer parameter ids) and `state` (per id: `step`, `exp_avg`, `exp_avg_sq`). The ids
number the parameters of the Trainer's groups in order, and the groups are those
`Trainer.create_optimizer` builds (transformers 5.x): first the parameters that take weight decay,
then the others, each in the model's `named_parameters()` order (a tied embedding once), trainable
ones only. A parameter takes no decay when it lies in an `nn.LayerNorm` or its lower-cased name
matches one of `NO_DECAY` (`Trainer.get_decay_parameter_names`).

The model's `named_parameters()` order comes from transformers' own class for config.json, built
on the meta device (no memory, no weights). The rebuilt groups are checked against the file:
the number of groups, each group's size, and every state's shape against its parameter's; any
difference is refused in one line (frozen parameters, another group split, another model).
Optimizers other than Adam/AdamW are refused from their state keys and group fields.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from megazoo.training.checkpoint import format as ckpt

logger = logging.getLogger(__name__)

NO_DECAY = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}
ADAM_FIELDS = {"lr", "betas", "eps", "weight_decay"}


def trainer_groups(hf_config) -> tuple[list[list[str]], dict[str, tuple]]:
    """([decay names, no-decay names], name -> shape) as the Trainer groups the model of
    `hf_config` (a transformers config)."""
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"transformers cannot build the {hf_config.model_type} model "
                                   f"of config.json ({e}); the optimizer's parameter order is "
                                   f"unknown: import with --no-optimizer") from None
    in_norm = {f"{m_name}.{p_name}" if m_name else p_name
               for m_name, m in model.named_modules() if isinstance(m, nn.LayerNorm)
               for p_name, _ in m.named_parameters(recurse=False)}
    patterns = [re.compile(p) for p in NO_DECAY]
    groups, shapes = [[], []], {}
    for name, p in model.named_parameters():
        no_decay = name in in_norm or any(pat.search(name.lower()) for pat in patterns)
        groups[no_decay].append(name)
        shapes[name] = tuple(p.shape)
    return groups, shapes


def check_adam(osd: dict, path: str, which: str = "optim='adamw_torch[_fused]'") -> None:
    """Refuse anything but torch's Adam/AdamW state (one line naming what it is; `which` names
    the saver's setting that gives AdamW)."""
    if not isinstance(osd, dict) or not {"state", "param_groups"} <= set(osd):
        raise ckpt.CheckpointError(f"{path}: not a torch optimizer state_dict (no state / "
                                   f"param_groups); was the run's optimizer wrapped?")
    keys = {k for st in osd["state"].values() for k in st}
    fields = {k for g in osd["param_groups"] for k in g}
    if keys - ADAM_STATE or not ADAM_FIELDS <= fields:
        raise ckpt.CheckpointError(
            f"{path}: the optimizer's state holds {sorted(keys)} and its groups "
            f"{sorted(fields - {'params'})}; "
            f"megazoo continues torch Adam/AdamW only ({which}); import the "
            f"weights with --no-optimizer")
    for g in osd["param_groups"]:
        if g.get("amsgrad") or g.get("maximize"):
            raise ckpt.CheckpointError(f"{path}: AdamW with amsgrad/maximize, which megazoo's "
                                       f"AdamW does not model; import with --no-optimizer")
        if g.get("weight_decay") and g.get("decoupled_weight_decay") is False:
            raise ckpt.CheckpointError(f"{path}: torch Adam with weight_decay={g['weight_decay']} "
                                       f"(L2 in the gradient, not AdamW's decoupled decay); "
                                       f"import with --no-optimizer")


def named_states(osd: dict, hf_config, path: str) -> tuple[dict[str, dict], int]:
    """({exp_avg, exp_avg_sq} -> HF name -> tensor, the step every parameter took)."""
    check_adam(osd, path)
    groups, shapes = trainer_groups(hf_config)
    saved = [list(g["params"]) for g in osd["param_groups"]]
    sizes, want = [len(s) for s in saved], [len(g) for g in groups]
    if sizes != want:
        raise ckpt.CheckpointError(
            f"{path}: the optimizer's groups hold {sizes} parameters, the Trainer's decay / "
            f"no-decay groups of this config.json {want}; the run froze parameters or grouped "
            f"them otherwise: import with --no-optimizer")
    out, steps = {"exp_avg": {}, "exp_avg_sq": {}}, {}
    for ids, names in zip(saved, groups):
        for pid, name in zip(ids, names):
            st = osd["state"].get(pid)
            if not st:
                raise ckpt.CheckpointError(f"{path}: no Adam state for {name} (parameter id "
                                           f"{pid}): it never took a step; import with "
                                           f"--no-optimizer")
            for key in out:
                if tuple(st[key].shape) != shapes[name]:
                    raise ckpt.CheckpointError(
                        f"{path}: parameter id {pid}'s {key} has shape {tuple(st[key].shape)}, "
                        f"{name} of config.json {shapes[name]}; the optimizer belongs to another "
                        f"model")
                out[key][name] = st[key]
            steps[name] = int(st["step"])
    if len(set(steps.values())) != 1:
        raise ckpt.CheckpointError(f"{path}: the parameters took different numbers of Adam steps "
                                   f"({sorted(set(steps.values()))}); megazoo keeps one count")
    _note_decay(groups, shapes, osd["param_groups"])
    return out, next(iter(steps.values()))


def _note_decay(groups, shapes, param_groups) -> None:
    """megazoo decays matrices (dim >= 2) and not vectors (--decay-biases-and-norms aside); say
    which parameters the Trainer treated otherwise, when it decayed at all."""
    decay = float(param_groups[0].get("weight_decay", 0.0))
    if not decay:
        return
    other = [n for n in groups[0] if len(shapes[n]) < 2] + \
        [n for n in groups[1] if len(shapes[n]) >= 2]
    if other:
        logger.warning("the Trainer's weight decay (%g) treated %d parameters otherwise than "
                       "megazoo will (matrices decay, vectors do not), e.g. %s", decay,
                       len(other), other[0])


def hyperparameters(osd: dict) -> dict:
    """The decay group's Adam hyperparameters as megazoo's flags."""
    g = osd["param_groups"][0]
    beta1, beta2 = g["betas"]
    return {"--adam-beta1": beta1, "--adam-beta2": beta2, "--adam-eps": g["eps"],
            "--weight-decay": g["weight_decay"]}
