"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (none on o_proj or the MLP);
the mapping to and from Hugging Face `Qwen2ForCausalLM` tensors is Llama's (models/llama.py)."""
from __future__ import annotations

from .config import TransformerConfig
from .hf_fields import check_fields, refuse
from .llama import (MAPPED as LLAMA_MAPPED, LlamaModel, from_hf_state_dict,  # noqa: F401
                    llama_like_config, llama_like_hf_fields, to_hf_state_dict)

FAMILY = "Qwen2"
MAPPED = (LLAMA_MAPPED - {"attention_bias", "mlp_bias", "head_dim"}) | {
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


class Qwen2Model(LlamaModel):
    """Llama blocks; models/family_rules.py says what the config holds."""


def check_full_attention(hf, family: str) -> None:
    """Sliding-window layers are not modelled: every layer must attend to the full context.
    transformers derives `layer_types` from use_sliding_window, sliding_window and
    max_window_layers, and its model reads only `layer_types`."""
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise refuse(family, "layer_types", other, "'full_attention' in every layer "
                     "(use_sliding_window=False)")


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen2Config` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED)
    check_full_attention(hf, FAMILY)
    return llama_like_config(hf, FAMILY, family="qwen2", add_qkv_bias=True)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen2Config` of a megazoo Qwen2 configuration (for export)."""
    from transformers import Qwen2Config
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=True, qk_layernorm=False)
    if config.bias or config.kv_channels is not None:
        raise ValueError("HF Qwen2 has biases on q, k, v only and head_dim = hidden/heads; this "
                         "model differs and cannot be exported as Qwen2")
    fields.pop("head_dim")
    return Qwen2Config(**fields, use_sliding_window=False,
                       **{"architectures": ["Qwen2ForCausalLM"], **extra})
