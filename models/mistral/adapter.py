"""Mistral's Hugging Face adapter: `MistralConfig` both ways (`sliding_window`: a query sees
itself and the window - 1 keys before it; None: the whole context); the tensors of
`MistralForCausalLM` are the Llama-shaped families' shared mapping (models/llama_like.py).

transformers' Mistral reads no `layer_types` (it warns and points to Ministral), so a config.json
that carries one is refused by the field guard rather than half-honoured.
"""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields
from ..llama_like import (MAPPED as LLAMA_MAPPED, from_hf_state_dict,  # noqa: F401
                          llama_like_config, llama_like_hf_fields, to_hf_state_dict,
                          window_from_hf)

FAMILY = "Mistral"
MAPPED = (LLAMA_MAPPED - {"attention_bias", "mlp_bias"}) | {"sliding_window"}


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.MistralConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED)
    return llama_like_config(hf, FAMILY, family="mistral", **window_from_hf(hf, FAMILY, None))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.MistralConfig` of a megazoo Mistral configuration (for export)."""
    from transformers import MistralConfig
    if config.bias or config.full_attention_layers:
        raise ValueError("HF Mistral has no biases and one sliding window for every layer; this "
                         "model differs and cannot be exported as Mistral")
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=False, qk_layernorm=False)
    return MistralConfig(**fields, sliding_window=config.sliding_window,
                         **{"architectures": ["MistralForCausalLM"], **extra})
