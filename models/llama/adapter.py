"""Llama's Hugging Face adapter: `LlamaConfig` both ways; the tensors of `LlamaForCausalLM` are
the Llama-shaped families' shared mapping (models/llama_like.py)."""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..llama_like import (IGNORED, MAPPED, from_hf_state_dict,  # noqa: F401
                          llama_like_config, llama_like_hf_fields, to_hf_state_dict)


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.LlamaConfig` (every field checked)."""
    check_fields(hf, "Llama", MAPPED, IGNORED)
    attention_bias, mlp_bias = getattr(hf, "attention_bias", False), getattr(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise refuse("Llama", "mlp_bias", mlp_bias, f"mlp_bias = attention_bias = {attention_bias}")
    return llama_like_config(hf, "Llama", family="llama", bias=bool(attention_bias))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.LlamaConfig` for a megazoo Llama config (extra keys passed through)."""
    from transformers import LlamaConfig
    fields = llama_like_hf_fields(config, "Llama", add_qkv_bias=False, qk_layernorm=False)
    return LlamaConfig(**fields, attention_bias=config.bias, mlp_bias=config.bias,
                       **{"architectures": ["LlamaForCausalLM"], **extra})
