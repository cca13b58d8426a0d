"""Qwen2-MoE's Hugging Face adapter: `Qwen2MoeConfig` both ways; the `Qwen2MoeForCausalLM`
tensors are the Qwen-MoE families' shared mapping (models/qwen_moe_like.py) with the shared
expert."""
from __future__ import annotations

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..llama_like import (MAPPED as LLAMA_MAPPED, WINDOW_MAPPED, check_full_attention,
                          llama_like_config, llama_like_hf_fields)
from ..qwen_moe_like import (IGNORED, MOE_MAPPED, from_hf_state_dict,  # noqa: F401
                             moe_config_fields, moe_hf_fields, to_hf_state_dict)

FAMILY = "Qwen2-MoE"
MAPPED = ((LLAMA_MAPPED - {"attention_bias", "mlp_bias"}) | WINDOW_MAPPED | MOE_MAPPED
          | {"head_dim", "qkv_bias", "shared_expert_intermediate_size"})


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen2MoeConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, IGNORED)
    check_full_attention(hf, FAMILY)
    if not hf.shared_expert_intermediate_size:
        raise refuse(FAMILY, "shared_expert_intermediate_size", hf.shared_expert_intermediate_size,
                     ">= 1")
    return llama_like_config(hf, FAMILY, family="qwen2_moe", add_qkv_bias=bool(hf.qkv_bias),
                             moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                             moe_shared_expert_gate=True, **moe_config_fields(hf, FAMILY))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen2MoeConfig` of a megazoo Qwen2-MoE configuration (for export)."""
    from transformers import Qwen2MoeConfig
    moe = moe_hf_fields(config, FAMILY, shared=True)
    fields = llama_like_hf_fields(config, FAMILY, add_qkv_bias=config.add_qkv_bias,
                                  qk_layernorm=False)
    if config.kv_channels is None:  # HF's default head_dim, written only when it differs
        fields.pop("head_dim")
    shared = config.moe_shared_expert_intermediate_size
    return Qwen2MoeConfig(**fields, **moe, qkv_bias=config.add_qkv_bias, use_sliding_window=False,
                          shared_expert_intermediate_size=shared,
                          **{"architectures": ["Qwen2MoeForCausalLM"], **extra})
