"""LoRA adapters in PEFT's format: a folder with `adapter_config.json` and
`adapter_model.safetensors` (keys `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
`base_model.model.transformer.h.N.attn.c_attn.lora_A.weight`, ...: A [r, in] and B [out, r]), as `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained`
reads; and the merge of adapters into Hugging Face weights (PEFT's `merge_and_unload`:
W + scale * B @ A).

megazoo names the same tensors `layers.N.attention.qkv.lora.A_q_proj` (models/lora_targets.py,
family by family).
Beside the family adapters' HF mappings because the run's flags (--lora-init), the trainer and
the export all read it.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from . import lora_targets as lt
from megazoo.parallel.lora import lora_scale


CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT config fields megazoo does not model: refused unless at their neutral value
_NEUTRAL = dict(use_dora=False, bias="none", fan_in_fan_out=False, modules_to_save=None,
                layers_to_transform=None, rank_pattern={}, alpha_pattern={}, layer_replication=None)


class AdapterError(ValueError):
    """A PEFT adapter folder megazoo cannot use (the message names the file and the field)."""


def read_adapter_config(folder: str, family: str = "llama", q_lora_rank: int | None = None,
                        weights: bool = True) -> dict:
    """{rank, alpha, dropout, targets, rslora} of a PEFT LoRA folder, every field checked
    (`weights` False: adapter_config.json alone, the tensors being elsewhere)."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path) or (weights and not os.path.isfile(os.path.join(folder, WEIGHTS))):
        raise AdapterError(f"--lora-init {folder}: needs {CONFIG} and {WEIGHTS} "
                           f"(a folder written by PeftModel.save_pretrained)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters load")
    table = lt.table(family)
    neutral_of = {**_NEUTRAL, "fan_in_fan_out": table.fan_in_fan_out}
    for field, neutral in neutral_of.items():
        value = cfg.get(field, neutral)
        if field == "fan_in_fan_out" and table.fan_in_fan_out:
            continue  # GPT-2's Conv1D: PEFT sets it itself (and warns when it was not given)
        if value != neutral and not (neutral in ({}, None) and not value):
            raise AdapterError(f"{path}: {field}={value!r} is not supported (megazoo's LoRA "
                               f"has {field}={neutral!r})")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != lt.ALL_LINEAR:
        raise AdapterError(f"{path}: target_modules {targets!r} is a pattern; give a list of "
                           f"{', '.join(table.targets)}")
    try:
        chosen = lt.parse_targets(lt.ALL_LINEAR if targets == lt.ALL_LINEAR else list(targets or []),
                                  family, q_lora_rank)
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from None
    return dict(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)),
                dropout=float(cfg.get("lora_dropout", 0.0)), targets=chosen,
                rslora=bool(cfg.get("use_rslora", False)))


def _names(config, targets):
    """{PEFT key: (megazoo name, megazoo module, which)} of every adapter tensor."""
    return {lt.peft_name(config.family, i, hf, w): (lt.megazoo_name(i, mz, n, w), mz, w)
            for i in range(config.num_layers) for n, mz, hf in lt.sites(config.family, targets)
            for w in "AB"}


def read_adapter(folder: str, targets: tuple[str, ...], config) -> dict[str, torch.Tensor]:
    """The adapter's tensors by megazoo name (fp32, megazoo's row layout); every tensor mapped,
    every target present."""
    return from_peft_keys(load_file(os.path.join(folder, WEIGHTS)), targets, config,
                          f"{folder}/{WEIGHTS}")


def from_peft_keys(sd: dict[str, torch.Tensor], targets: tuple[str, ...], config,
                   where: str) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's keys (saved: `...lora_A.weight`; a live PeftModel's
    parameters: `...lora_A.default.weight`) by megazoo name (fp32, megazoo's row layout); every
    key mapped, every target present, else AdapterError naming `where`."""
    sd = {k.replace(".default.weight", ".weight"): v for k, v in sd.items()}
    names = _names(config, targets)
    unknown = sorted(set(sd) - set(names))
    missing = sorted(set(names) - set(sd))
    if unknown or missing:
        raise AdapterError(f"{where}: does not match its {CONFIG} and the model "
                           f"({config.family}, {config.num_layers} layers): missing {missing[:2]}, "
                           f"unexpected {unknown[:2]}")
    return {name: lt.to_megazoo_rows(config, mz, w, sd[key].float())
            for key, (name, mz, w) in names.items()}


def adapter_config(lora: dict, base: str | None = None, family: str = "llama") -> dict:
    """The adapter_config.json PEFT reads for megazoo's LoRA record (resume.lora_record)."""
    return dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base,
                r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                target_modules=list(lora["targets"]), use_rslora=lora.get("rslora", False),
                init_lora_weights=True, inference_mode=True,
                **{**_NEUTRAL, "fan_in_fan_out": lt.table(family).fan_in_fan_out})


def write_adapter(folder: str, lora: dict, tensors: dict[str, torch.Tensor], config,
                  dtype: torch.dtype, base: str | None = None) -> None:
    """PEFT's adapter folder from megazoo's adapter tensors (full, by megazoo name)."""
    sd = {key: lt.to_hf_rows(config, mz, w, tensors[name]).detach().to(dtype).contiguous()
          for key, (name, mz, w) in _names(config, lora["targets"]).items()}
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(adapter_config(lora, base, config.family), f, indent=2)


def merge_into(hf_sd: dict[str, torch.Tensor], lora: dict, tensors: dict[str, torch.Tensor],
               config) -> None:
    """Fold the adapters into HF weights in place: W += scale * B @ A (in fp32; transposed for
    GPT-2's Conv1D [in, out] weights)."""
    scale = lora_scale(lora["rank"], lora["alpha"], lora.get("rslora", False))
    conv1d = lt.table(config.family).fan_in_fan_out
    for i in range(config.num_layers):
        for target, mz, hf in lt.sites(config.family, lora["targets"]):
            key = lt.hf_weight(config.family, i, hf)
            a, b = (lt.to_hf_rows(config, mz, w, tensors[lt.megazoo_name(i, mz, target, w)]).float()
                    for w in "AB")
            delta = scale * (b @ a)
            hf_sd[key] = (hf_sd[key].float() + (delta.t() if conv1d else delta)).to(hf_sd[key].dtype)
