"""Qwen3.5 text <-> transformers for megazoo's trainable stack (the family folder's adapter,
models/family_folders.py): configs go through models/qwen3_5/hf.py's field checks (every field
mapped, neutral or refused there); layers and tensors as models/qwen35_like.py maps them."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..qwen3_5 import hf
from ..qwen3_5.model import Qwen35Config
from ..qwen35_like import layers_from_hf, layers_to_hf, standalone_fields, transformer_fields


def config_from_hf(hf_cfg) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3_5TextConfig` (every field checked)."""
    return TransformerConfig(**transformer_fields(hf.config_from_hf(hf_cfg), "qwen3_5_text", hf.FAMILY))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen3_5TextConfig` of a megazoo Qwen3.5 config (for export)."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**{**hf.hf_fields(Qwen35Config(**standalone_fields(config))), **extra})


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """transformers' Qwen3_5ForCausalLM tensors -> full megazoo tensors."""
    sd = hf.from_hf_state_dict(sd, Qwen35Config(**standalone_fields(config)))
    return {k: v.contiguous() for k, v in layers_from_hf(sd, config).items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> transformers' Qwen3_5ForCausalLM tensors (no lm_head when tied)."""
    return {k: v.contiguous() for k, v in layers_to_hf(full, config).items()}
