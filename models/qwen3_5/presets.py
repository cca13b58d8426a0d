"""Published Qwen3.5 text sizes as transformers `Qwen3_5TextConfig` fields (`preset_config` goes
through the importer's field checks). qwen3.5-9b is transformers' own default configuration,
which its documentation names the Qwen3.5-9B shape (32 layers, three Gated DeltaNet layers per
gated-attention layer).

`HF_PRESETS`: the transformers config fields (`preset_config` runs them through hf.py's
importer); `PRESETS`: the same shapes as megazoo TransformerConfig fields (`--model NAME`, read by
models/presets.py; tests/models/test_hybrid_training.py checks they equal the importer's), and
qwen3.5-tiny for CPUs and tests."""
from __future__ import annotations

_LIN, _ATT = "gated_deltanet", "gated_attention"
_QWEN35 = dict(family="qwen3_5_text", position_embedding="rope", normalization="rmsnorm_offset",
               activation="swiglu", qk_layernorm=True, bias=False, layernorm_epsilon=1e-6,
               tie_word_embeddings=False, hidden_dropout=0.0)

PRESETS = {
    "qwen3.5-9b": dict(_QWEN35, vocab_size=248320, hidden_size=4096, num_layers=32,
                       num_attention_heads=16, num_query_groups=4, kv_channels=256,
                       ffn_hidden_size=12288, max_position_embeddings=32768, rope_theta=10000.0,
                       token_mixers=(_LIN, _LIN, _LIN, _ATT) * 8, rotary_fraction=0.25,
                       linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4),
    # a tiny Qwen3.5 for CPUs and tests: linear and full layers alternating (a pipeline stage of
    # two layers holds both kinds), chunk 8 (context-parallel cuts fall inside chunks)
    "qwen3.5-tiny": dict(_QWEN35, vocab_size=128, hidden_size=32, num_layers=4,
                         num_attention_heads=4, num_query_groups=2, kv_channels=8,
                         ffn_hidden_size=64, max_position_embeddings=256, rope_theta=10000.0,
                         token_mixers=(_LIN, _ATT) * 2, rotary_fraction=0.5,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                         linear_chunk_size=8),
}

HF_PRESETS = {
    "qwen3.5-9b": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, max_position_embeddings=32768,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.25}),
}


def preset_config(name: str):
    """The megazoo Qwen35Config of a preset."""
    from transformers import Qwen3_5TextConfig

    from .hf import config_from_hf
    if name not in HF_PRESETS:
        raise ValueError(f"--model {name}: not a Qwen3.5 preset; presets: {sorted(HF_PRESETS)}")
    return config_from_hf(Qwen3_5TextConfig(**HF_PRESETS[name]))
