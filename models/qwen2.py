"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (none on o_proj or the MLP);
the mapping to and from Hugging Face `Qwen2ForCausalLM` tensors is Llama's (models/llama.py)."""
from __future__ import annotations

from .config import TransformerConfig
from .hf_fields import check_fields, refuse
from .llama import (MAPPED as LLAMA_MAPPED, LlamaModel, from_hf_state_dict,  # noqa: F401
                    llama_like_config, llama_like_hf_fields, to_hf_state_dict, window_from_hf,
                    window_hf_fields)

FAMILY = "Qwen2"
MAPPED = (LLAMA_MAPPED - {"attention_bias", "mlp_bias"}) | {
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


class Qwen2Model(LlamaModel):
    """Llama blocks; models/family_rules.py says what the config holds."""

    family = "qwen2"


def check_full_attention(hf, family: str) -> None:
    """For the families without sliding windows (Qwen2-MoE): every layer attends to the whole
    context (transformers derives `layer_types` from use_sliding_window and max_window_layers)."""
    if window_from_hf(hf, family, hf.layer_types)["sliding_window"] is not None:
        raise refuse(family, "layer_types", hf.layer_types, "'full_attention' in every layer "
                     "(use_sliding_window=False)")


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
