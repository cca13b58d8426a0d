"""Qwen2's Hugging Face adapter: `Qwen2Config` both ways; the tensors of `Qwen2ForCausalLM` are
the Llama-shaped families' shared mapping (models/llama_like.py)."""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields
from ..llama_like import (MAPPED as LLAMA_MAPPED, WINDOW_MAPPED, from_hf_state_dict,  # noqa: F401
                          llama_like_config, llama_like_hf_fields, to_hf_state_dict,
                          window_from_hf, window_hf_fields)

FAMILY = "Qwen2"
MAPPED = (LLAMA_MAPPED - {"attention_bias", "mlp_bias"}) | WINDOW_MAPPED


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen2Config` (every field checked; head_dim may
    differ from hidden/heads, as transformers' Qwen2 reads it)."""
    check_fields(hf, FAMILY, MAPPED)
    return llama_like_config(hf, FAMILY, family="qwen2", add_qkv_bias=True,
                             **window_from_hf(hf, FAMILY, hf.layer_types))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen2Config` of a megazoo Qwen2 configuration (for export)."""
    from transformers import Qwen2Config
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=True, qk_layernorm=False)
    if config.bias:
        raise ValueError("HF Qwen2 has biases on q, k, v only; this model differs and cannot be "
                         "exported as Qwen2")
    if config.kv_channels is None:
        fields.pop("head_dim")  # the derived default, as Qwen2 files have it
    return Qwen2Config(**fields, **window_hf_fields(config),
                       **{"architectures": ["Qwen2ForCausalLM"], **extra})
