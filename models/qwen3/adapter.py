"""Qwen3's Hugging Face adapter: `Qwen3Config` both ways; the tensors of `Qwen3ForCausalLM` are
the Llama-shaped families' shared mapping (models/llama_like.py), with the q/k norms."""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..llama_like import (MAPPED as LLAMA_MAPPED, WINDOW_MAPPED, from_hf_state_dict,  # noqa: F401
                          llama_like_config, llama_like_hf_fields, to_hf_state_dict,
                          window_from_hf, window_hf_fields)

FAMILY = "Qwen3"
MAPPED = (LLAMA_MAPPED - {"mlp_bias"}) | WINDOW_MAPPED


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3Config` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED)
    if hf.attention_bias:  # q, k, v and o biased, the MLP not: megazoo has no o-only bias
        raise refuse(FAMILY, "attention_bias", hf.attention_bias, False)
    return llama_like_config(hf, FAMILY, family="qwen3", qk_layernorm=True,
                             **window_from_hf(hf, FAMILY, hf.layer_types))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen3Config` of a megazoo Qwen3 configuration (for export)."""
    from transformers import Qwen3Config
    if config.bias:
        raise ValueError("HF Qwen3 has no biases; this model differs and cannot be exported as Qwen3")
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=False, qk_layernorm=True)
    return Qwen3Config(**fields, attention_bias=False, **window_hf_fields(config),
                       **{"architectures": ["Qwen3ForCausalLM"], **extra})
