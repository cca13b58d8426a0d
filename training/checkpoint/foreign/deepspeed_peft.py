"""DeepSpeed ZeRO checkpoints of PEFT LoRA runs, imported as megazoo LoRA runs.

A PEFT model (`get_peft_model`) trained by DeepSpeed's engine names its parameters
`base_model.model.<the Hugging Face name>`, the targeted linears' base weights
`...q_proj.base_layer.weight` and the adapters `...q_proj.lora_A.default.weight`; only the
adapters train, so the ZeRO optimizer files hold their fp32 masters and Adam moments alone. The
Hugging Face Trainer saves such a run with `exclude_frozen_parameters=True`: the base weights are
then in no DeepSpeed file and come from the base model's folder (`--hf-config`: config.json and
its safetensors); a run saved with them (ZeRO-2/3's `frozen_param_fragments`) takes them from
there. The adapter's rank, alpha, dropout and targets come from the `adapter_config.json` PEFT's
`save_pretrained` writes beside DeepSpeed's `latest` (the Trainer's `checkpoint-N/`), checked as
`--lora-init` checks it; the import records them as megazoo's LoRA (`meta.json` `lora`), so the
run continues with its adapters, masters, moments and step.
"""
from __future__ import annotations

import logging
import os

import torch

from megazoo.models.peft_format import CONFIG, AdapterError, from_peft_keys, read_adapter_config
from megazoo.training.checkpoint import format as ckpt

logger = logging.getLogger(__name__)

PREFIX = "base_model.model."  # a PeftModel over a *ForCausalLM


def is_peft(names) -> bool:
    names = list(names)
    return bool(names) and all(n.startswith(PREFIX) for n in names)


def _checkpoint_dir(folder: str) -> str:
    """The folder holding DeepSpeed's `latest` (the Trainer's checkpoint-N/)."""
    return os.path.dirname(os.path.abspath(folder))


def base_folder(folder: str, hf_config: str | None, names) -> str:
    """The base model's Hugging Face folder: --hf-config, else the adapter_config.json's
    base_model_name_or_path where that is a local folder with a config.json (logged)."""
    if hf_config:
        return hf_config
    path = os.path.join(_checkpoint_dir(folder), CONFIG)
    base = None
    if os.path.isfile(path):
        import json
        with open(path) as f:
            base = json.load(f).get("base_model_name_or_path")
    if base and os.path.isfile(os.path.join(base, "config.json")):
        logger.info("%s: no --hf-config; using the base model folder %s named by %s", folder,
                    base, path)
        return base
    example = next(iter(names))
    raise ckpt.CheckpointError(f"{folder}: a PEFT run's DeepSpeed checkpoint (e.g. {example}) "
                               f"holds the adapters, not the base model; pass --hf-config with "
                               f"the base model's folder (config.json and its safetensors)")


def lora_record(folder: str, config, names) -> dict:
    """megazoo's LoRA record from PEFT's adapter_config.json beside DeepSpeed's `latest`."""
    where = _checkpoint_dir(folder)
    if not os.path.isfile(os.path.join(where, CONFIG)):
        raise ckpt.CheckpointError(
            f"{folder}: a PEFT run's DeepSpeed checkpoint (adapters such as {next(iter(names))}) "
            f"needs the {CONFIG} PEFT saved beside it (the Trainer's checkpoint-N/{CONFIG}); copy "
            f"it into {where}")
    try:
        fields = read_adapter_config(where, config.family, config.q_lora_rank, weights=False)
    except (AdapterError, ValueError) as e:
        raise ckpt.CheckpointError(str(e)) from None
    return dict(rank=fields["rank"], alpha=fields["alpha"], dropout=fields["dropout"],
                targets=list(fields["targets"]), rslora=fields["rslora"])


def adapters(flat: dict[str, torch.Tensor], config, lora: dict, folder: str) -> dict:
    """The adapter tensors (one state: masters or a moment) by megazoo name."""
    trained = {k for k in flat if ".lora_" not in k}
    if trained:
        raise ckpt.CheckpointError(
            f"{folder}: the PEFT run also trained {sorted(trained)[0]} (modules_to_save or a "
            f"bias), which megazoo's LoRA keeps frozen; it cannot continue this run")
    try:
        return from_peft_keys(flat, tuple(lora["targets"]), config,
                              f"{folder} (its optimizer's parameters)")
    except AdapterError as e:
        raise ckpt.CheckpointError(str(e)) from None


def hf_base_names(frozen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PeftModel's frozen base parameters under the Hugging Face model's names."""
    return {k.removeprefix(PREFIX).replace(".base_layer.", "."): v for k, v in frozen.items()}


def base_weights(hf_folder: str, module, config, frozen: dict | None, folder: str) -> dict:
    """The frozen base model's weights by megazoo name: from the run's frozen_param_fragments
    where it saved them, else the base model folder's weight files (logged)."""
    if frozen:
        try:
            return {k: v.float() for k, v in
                    module.from_hf_state_dict(hf_base_names(frozen), config).items()}
        except KeyError as e:
            raise ckpt.CheckpointError(f"{folder}: the frozen parameters lack {e}; they do not "
                                       f"match {hf_folder}/config.json") from None
    from megazoo.training.checkpoint.hf import hf_to_full
    logger.info("%s: a PEFT run saved without its frozen base (exclude_frozen_parameters); the "
                "base weights come from %s", folder, hf_folder)
    return hf_to_full(hf_folder)[2].weights
