"""LoRA adapters in PEFT's format: a folder with `adapter_config.json` and
`adapter_model.safetensors` (keys `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
A [r, in] and B [out, r]), as `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained`
reads; and the merge of adapters into Hugging Face weights (PEFT's `merge_and_unload`:
W + scale * B @ A).

megazoo names the same tensors `layers.N.attention.qkv.lora.A_q_proj` (models/lora_targets.py).
Beside the family adapters' HF mappings because the run's flags (--lora-init), the trainer and
the export all read it.
"""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from . import lora_targets as lt
from megazoo.parallel.lora import lora_scale


CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")
# PEFT config fields megazoo does not model: refused unless at their neutral value
_NEUTRAL = dict(use_dora=False, bias="none", fan_in_fan_out=False, modules_to_save=None,
                layers_to_transform=None, rank_pattern={}, alpha_pattern={}, layer_replication=None)


class AdapterError(ValueError):
    """A PEFT adapter folder megazoo cannot use (the message names the file and the field)."""


def read_adapter_config(folder: str) -> dict:
    """{rank, alpha, dropout, targets, rslora} of a PEFT LoRA folder, every field checked."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, WEIGHTS)):
        raise AdapterError(f"--lora-init {folder}: needs {CONFIG} and {WEIGHTS} "
                           f"(a folder written by PeftModel.save_pretrained)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters load")
    for field, neutral in _NEUTRAL.items():
        value = cfg.get(field, neutral)
        if value != neutral and not (neutral in ({}, None) and not value):
            raise AdapterError(f"{path}: {field}={value!r} is not supported (megazoo's LoRA "
                               f"has {field}={neutral!r})")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != lt.ALL_LINEAR:
        raise AdapterError(f"{path}: target_modules {targets!r} is a pattern; give a list of "
                           f"{', '.join(lt.TARGETS)}")
    unknown = sorted(set(targets if isinstance(targets, list) else []) - set(lt.TARGETS))
    if unknown:
        raise AdapterError(f"{path}: target_modules {unknown} are not LoRA targets megazoo "
                           f"has; choose from {', '.join(lt.TARGETS)}")
    return dict(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)),
                dropout=float(cfg.get("lora_dropout", 0.0)),
                targets=tuple(lt.TARGETS) if targets == lt.ALL_LINEAR
                else tuple(n for n in lt.TARGETS if n in targets),
                rslora=bool(cfg.get("use_rslora", False)))


def read_adapter(folder: str, targets: tuple[str, ...], num_layers: int) -> dict[str, torch.Tensor]:
    """The adapter's tensors by megazoo name (fp32); every tensor mapped, every target present."""
    sd = load_file(os.path.join(folder, WEIGHTS))
    out = {}
    for key, t in sd.items():
        m = _KEY.fullmatch(key)
        target = m and m[3]
        if not m or target not in lt.TARGETS or lt.TARGETS[target][1] != f"{m[2]}.{m[3]}":
            raise AdapterError(f"{folder}/{WEIGHTS}: {key} is not a LoRA tensor of a Llama-shaped "
                               f"model's {', '.join(lt.TARGETS)}")
        out[lt.megazoo_name(int(m[1]), target, m[4])] = t.float()
    want = {lt.megazoo_name(i, n, w) for i in range(num_layers) for n in targets for w in "AB"}
    missing, extra = sorted(want - set(out)), sorted(set(out) - want)
    if missing or extra:
        raise AdapterError(f"{folder}/{WEIGHTS}: does not match its {CONFIG} and the model "
                           f"({num_layers} layers): missing {missing[:2]}, unexpected {extra[:2]}")
    return out


def adapter_config(lora: dict, base: str | None = None) -> dict:
    """The adapter_config.json PEFT reads for megazoo's LoRA record (resume.lora_record)."""
    return dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base,
                r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                target_modules=list(lora["targets"]), use_rslora=lora.get("rslora", False),
                init_lora_weights=True, inference_mode=True, **_NEUTRAL)


def write_adapter(folder: str, lora: dict, tensors: dict[str, torch.Tensor], num_layers: int,
                  dtype: torch.dtype, base: str | None = None) -> None:
    """PEFT's adapter folder from megazoo's adapter tensors (full, by megazoo name)."""
    sd = {}
    for i in range(num_layers):
        for target in lora["targets"]:
            for which in "AB":
                sd[lt.peft_name(i, target, which)] = \
                    tensors[lt.megazoo_name(i, target, which)].detach().to(dtype).contiguous()
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(adapter_config(lora, base), f, indent=2)


def merge_into(hf_sd: dict[str, torch.Tensor], lora: dict, tensors: dict[str, torch.Tensor],
               num_layers: int) -> None:
    """Fold the adapters into HF weights in place: W += scale * B @ A (in fp32)."""
    scale = lora_scale(lora["rank"], lora["alpha"], lora.get("rslora", False))
    for i in range(num_layers):
        for target in lora["targets"]:
            key = lt.hf_weight(i, target)
            a, b = (tensors[lt.megazoo_name(i, target, w)].float() for w in "AB")
            hf_sd[key] = (hf_sd[key].float() + scale * (b @ a)).to(hf_sd[key].dtype)
