"""Published Nemotron-H sizes as transformers `NemotronHConfig` fields (`preset_config` turns one
into a megazoo config through the importer, so a preset passes the same field checks as a
downloaded config.json). Shapes from NVIDIA's releases (Nemotron-H-4B/8B-Base-8K: 52 layers, the
pattern below; the 8B's in_proj of 18560 rows = 2 x 8192 + 2 x 8 x 128 + 128 pins heads, groups
and state). The 47B and 56B (Nemotron-H-47B/56B-Base-8K) as NVIDIA's Megatron-Bridge providers
give them: 98 and 118 layers of hidden 8192, 64 query heads of 128 in 8 groups, 256 Mamba heads
of 64 with state 256 in 8 groups, MLP 30720 / 32768; the 56B's pattern has the 54 Mamba-2, 54 MLP
and 10 attention layers of its model card.

`HF_PRESETS`: the transformers config fields (`preset_config` runs them through hf.py's
importer); `PRESETS`: the same shapes as megazoo TransformerConfig fields (`--model NAME`), and
nemotron-h-tiny for CPUs and tests."""
from __future__ import annotations

PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_MIXER = {"M": "mamba2", "*": "attention", "-": "none", "E": "none"}
_MLP = {"M": "none", "*": "none", "-": "dense", "E": "moe"}


def _layers(pattern: str) -> dict:
    """token_mixers and layer_mlps of a hybrid_override_pattern."""
    return dict(num_layers=len(pattern), token_mixers=tuple(_MIXER[c] for c in pattern),
                layer_mlps=tuple(_MLP[c] for c in pattern))


_NEMOTRON_H = dict(family="nemotron_h", position_embedding="none", normalization="rmsnorm",
                   activation="relu2", bias=False, tie_word_embeddings=False, hidden_dropout=0.0,
                   layernorm_epsilon=1e-5, mamba_time_step_min=0.001)

PATTERN_98 = ("M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---"
              "M-M*-M-M-M-M-M-")
PATTERN_118 = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*"
               "-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
_LARGE = dict(vocab_size=131072, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
              head_dim=128, mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256, n_groups=8,
              conv_kernel=4, chunk_size=128, max_position_embeddings=8192)

_LARGE_FIELDS = dict(vocab_size=131072, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                     kv_channels=128, max_position_embeddings=8192, mamba_num_heads=256,
                     mamba_head_dim=64, mamba_state_size=256, mamba_groups=8,
                     linear_conv_kernel=4, linear_chunk_size=128)

PRESETS = {
    "nemotron-h-4b": dict(_NEMOTRON_H, **_layers(PATTERN_52), vocab_size=131072,
                          hidden_size=3072, num_attention_heads=32, num_query_groups=8,
                          kv_channels=128, ffn_hidden_size=12288, max_position_embeddings=8192,
                          mamba_num_heads=112, mamba_head_dim=64, mamba_state_size=128,
                          mamba_groups=8, linear_conv_kernel=4, linear_chunk_size=128),
    "nemotron-h-8b": dict(_NEMOTRON_H, **_layers(PATTERN_52), vocab_size=131072,
                          hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                          kv_channels=128, ffn_hidden_size=21504, max_position_embeddings=8192,
                          mamba_num_heads=128, mamba_head_dim=64, mamba_state_size=128,
                          mamba_groups=8, linear_conv_kernel=4, linear_chunk_size=128),
    "nemotron-h-47b": dict(_NEMOTRON_H, **_layers(PATTERN_98), **_LARGE_FIELDS, ffn_hidden_size=30720),
    "nemotron-h-56b": dict(_NEMOTRON_H, **_layers(PATTERN_118), **_LARGE_FIELDS, ffn_hidden_size=32768),
    # a tiny Nemotron-H for CPUs and tests: Mamba-2, attention | Mamba-2, MLP (a pipeline
    # stage of two layers holds two kinds), chunk 8
    "nemotron-h-tiny": dict(_NEMOTRON_H, **_layers("M*M-"), vocab_size=128, hidden_size=32,
                            num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            ffn_hidden_size=64, max_position_embeddings=256, mamba_num_heads=4,
                            mamba_head_dim=8, mamba_state_size=8, mamba_groups=2,
                            linear_conv_kernel=4, linear_chunk_size=8),
    # the same with MoE layers ("E", as in NVIDIA's Nemotron-3 Nano MoE release) beside a dense
    # one: 4 squared-ReLU experts, top-2 of 2 groups' best 1, sigmoid with the correction bias
    "nemotron-h-moe-tiny": dict(_NEMOTRON_H, **_layers("ME*-E"), vocab_size=128, hidden_size=32,
                                num_attention_heads=4, num_query_groups=2, kv_channels=8,
                                ffn_hidden_size=64, max_position_embeddings=256,
                                mamba_num_heads=4, mamba_head_dim=8, mamba_state_size=8,
                                mamba_groups=2, linear_conv_kernel=4, linear_chunk_size=8,
                                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                                moe_shared_expert_intermediate_size=24,
                                moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_norm_topk_prob=True,
                                moe_router_num_groups=2, moe_router_group_topk=1,
                                moe_router_topk_scaling_factor=2.5),
}

HF_PRESETS = {
    "nemotron-h-4b": dict(vocab_size=131072, hidden_size=3072, hybrid_override_pattern=PATTERN_52,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          intermediate_size=12288, mamba_num_heads=112, mamba_head_dim=64,
                          ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
                          max_position_embeddings=8192),
    "nemotron-h-8b": dict(vocab_size=131072, hidden_size=4096, hybrid_override_pattern=PATTERN_52,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          intermediate_size=21504, mamba_num_heads=128, mamba_head_dim=64,
                          ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
                          max_position_embeddings=8192),
    "nemotron-h-47b": dict(_LARGE, hybrid_override_pattern=PATTERN_98, intermediate_size=30720),
    "nemotron-h-56b": dict(_LARGE, hybrid_override_pattern=PATTERN_118, intermediate_size=32768),
}


def preset_config(name: str):
    """The megazoo NemotronHConfig of a preset."""
    from transformers import NemotronHConfig

    from .hf import config_from_hf
    if name not in HF_PRESETS:
        raise ValueError(f"--model {name}: not a Nemotron-H preset; presets: {sorted(HF_PRESETS)}")
    return config_from_hf(NemotronHConfig(**HF_PRESETS[name]))
