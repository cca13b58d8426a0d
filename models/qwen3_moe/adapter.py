"""Qwen3-MoE's Hugging Face adapter: `Qwen3MoeConfig` both ways; the `Qwen3MoeForCausalLM`
tensors are the Qwen-MoE families' shared mapping (models/qwen_moe_like.py) without the shared
expert."""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..llama_like import MAPPED as LLAMA_MAPPED, llama_like_config, llama_like_hf_fields
from ..qwen_moe_like import (IGNORED as QWEN_MOE_IGNORED, MOE_MAPPED,  # noqa: F401
                             from_hf_state_dict, moe_config_fields, moe_hf_fields,
                             to_hf_state_dict)

FAMILY = "Qwen3-MoE"
# use_sliding_window and sliding_window are not mapped: a value other than the default (off) is
# refused by the field check. transformers' Qwen3-MoE never reads max_window_layers, which
# released config.json files carry. Qwen3MoeConfig stores num_experts as num_local_experts.
MAPPED = (LLAMA_MAPPED - {"mlp_bias"}) | MOE_MAPPED | {"num_local_experts"}
IGNORED = QWEN_MOE_IGNORED | {"max_window_layers"}
# Qwen3-Coder's config.json fields for Qwen's own code: transformers' Qwen3-MoE always normalises
# q and k, has no q/k/v bias and no shared expert
FIXED = {"use_qk_norm": True, "qkv_bias": False, "shared_expert_intermediate_size": 0}


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3MoeConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, IGNORED, FIXED)
    if hf.attention_bias:  # q, k, v and o biased, the MLP not: megazoo has no o-only bias
        raise refuse(FAMILY, "attention_bias", hf.attention_bias, False)
    return llama_like_config(hf, FAMILY, family="qwen3_moe", qk_layernorm=True,
                             **moe_config_fields(hf, FAMILY))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen3MoeConfig` of a megazoo Qwen3-MoE configuration (for export)."""
    from transformers import Qwen3MoeConfig
    moe = moe_hf_fields(config, FAMILY, shared=False)
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=False, qk_layernorm=True)
    return Qwen3MoeConfig(**fields, **moe, attention_bias=False, use_sliding_window=False,
                          **{"architectures": ["Qwen3MoeForCausalLM"], **extra})
