"""Published Qwen3-Next sizes as transformers `Qwen3NextConfig` fields (`preset_config` goes through
the importer's field checks). qwen3-next-80b-a3b is transformers' default configuration, which
its documentation names the Qwen3-Next-80B-A3B shape (48 layers, 512 experts, 10 routed per
token, one shared expert)."""
from __future__ import annotations

PRESETS = {
    "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                               head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, decoder_sparse_step=1,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                               max_position_embeddings=32768,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25}),
}


def preset_config(name: str):
    """The megazoo Qwen3NextConfig of a preset."""
    from transformers import Qwen3NextConfig

    from .hf import config_from_hf
    if name not in PRESETS:
        raise ValueError(f"--model {name}: not a Qwen3-Next preset; presets: {sorted(PRESETS)}")
    return config_from_hf(Qwen3NextConfig(**PRESETS[name]))
