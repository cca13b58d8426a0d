"""Published Qwen3-Next sizes as transformers `Qwen3NextConfig` fields (`preset_config` goes through
the importer's field checks). qwen3-next-80b-a3b is transformers' default configuration, which
its documentation names the Qwen3-Next-80B-A3B shape (48 layers, 512 experts, 10 routed per
token, one shared expert).

`HF_PRESETS`: the transformers config fields (`preset_config` runs them through hf.py's
importer); `PRESETS`: the same shapes as megazoo TransformerConfig fields (`--model NAME`), and
qwen3-next-tiny for CPUs and tests."""
from __future__ import annotations

_LIN, _ATT = "gated_deltanet", "gated_attention"
_NEXT = dict(family="qwen3_next", position_embedding="rope", normalization="rmsnorm_offset",
             activation="swiglu", qk_layernorm=True, bias=False, layernorm_epsilon=1e-6,
             tie_word_embeddings=False, hidden_dropout=0.0, moe_router_pre_softmax=True,
             moe_norm_topk_prob=True, moe_shared_expert_gate=True)

PRESETS = {
    "qwen3-next-80b-a3b": dict(_NEXT, vocab_size=151936, hidden_size=2048, num_layers=48,
                               num_attention_heads=16, num_query_groups=2, kv_channels=256,
                               ffn_hidden_size=5632, max_position_embeddings=32768,
                               rope_theta=10000.0, token_mixers=(_LIN, _LIN, _LIN, _ATT) * 12,
                               rotary_fraction=0.25, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel=4, num_experts=512,
                               moe_router_topk=10, moe_ffn_hidden_size=512,
                               moe_shared_expert_intermediate_size=512,
                               moe_aux_loss_coeff=1e-3 * 10),  # HF 1e-3 x top-k
    # a tiny Qwen3-Next for CPUs and tests: a dense first layer (mlp_only_layers), then MoE
    "qwen3-next-tiny": dict(_NEXT, vocab_size=128, hidden_size=32, num_layers=4,
                            num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            ffn_hidden_size=64, max_position_embeddings=256, rope_theta=10000.0,
                            token_mixers=(_LIN, _ATT) * 2, rotary_fraction=0.5,
                            linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                            linear_chunk_size=8, layer_mlps=("dense", "moe", "moe", "moe"),
                            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                            moe_shared_expert_intermediate_size=32),
}

HF_PRESETS = {
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
    if name not in HF_PRESETS:
        raise ValueError(f"--model {name}: not a Qwen3-Next preset; presets: {sorted(HF_PRESETS)}")
    return config_from_hf(Qwen3NextConfig(**HF_PRESETS[name]))
