"""Qwen3.5-MoE text sizes. qwen3.5-35b-a3b: the released Qwen3.5-35B-A3B's text model (its
config.json's text_config, tests/fixtures/released_hf_configs.json; transformers'
Qwen3_5MoeTextConfig defaults are the same shape): 40 layers, three Gated DeltaNet layers per
gated-attention layer, 256 experts, 8 routed per token, one shared expert; qwen3.5-moe-tiny for
CPUs and tests.

`HF_PRESETS`: the transformers config fields (`preset_config` runs them through the importer);
`PRESETS`: the same shapes as megazoo TransformerConfig fields (`--model NAME`, read by
models/presets.py; tests/models/test_hybrid_training.py checks they equal the importer's)."""
from __future__ import annotations

_LIN, _ATT = "gated_deltanet", "gated_attention"
_MOE = dict(family="qwen3_5_moe_text", position_embedding="rope", normalization="rmsnorm_offset",
            activation="swiglu", qk_layernorm=True, bias=False, layernorm_epsilon=1e-6,
            tie_word_embeddings=False, hidden_dropout=0.0, moe_router_pre_softmax=True,
            moe_norm_topk_prob=True, moe_shared_expert_gate=True)

PRESETS = {
    "qwen3.5-35b-a3b": dict(_MOE, vocab_size=248320, hidden_size=2048, num_layers=40,
                            num_attention_heads=16, num_query_groups=2, kv_channels=256,
                            ffn_hidden_size=512, max_position_embeddings=262144,
                            rope_theta=10000000.0, token_mixers=(_LIN, _LIN, _LIN, _ATT) * 10,
                            rotary_fraction=0.25, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel=4, num_experts=256,
                            moe_router_topk=8, moe_ffn_hidden_size=512,
                            moe_shared_expert_intermediate_size=512,
                            moe_aux_loss_coeff=1e-3 * 8),  # HF 1e-3 x top-k
    # a tiny Qwen3.5-MoE for CPUs and tests: linear and full layers alternating, every MLP sparse
    "qwen3.5-moe-tiny": dict(_MOE, vocab_size=128, hidden_size=32, num_layers=4,
                             num_attention_heads=4, num_query_groups=2, kv_channels=8,
                             ffn_hidden_size=32, max_position_embeddings=256, rope_theta=10000.0,
                             token_mixers=(_LIN, _ATT) * 2, rotary_fraction=0.5,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                             linear_chunk_size=8, num_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32),
}

HF_PRESETS = {
    "qwen3.5-35b-a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            linear_conv_kernel_dim=4, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_num_key_heads=16,
                            linear_num_value_heads=32, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_experts_per_tok=8,
                            num_experts=256, max_position_embeddings=262144,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}),
}


def preset_config(name: str):
    """The megazoo TransformerConfig of a preset, through the importer."""
    from transformers import Qwen3_5MoeTextConfig

    from .adapter import config_from_hf
    if name not in HF_PRESETS:
        raise ValueError(f"--model {name}: not a Qwen3.5-MoE preset; presets: {sorted(HF_PRESETS)}")
    return config_from_hf(Qwen3_5MoeTextConfig(**HF_PRESETS[name]))
