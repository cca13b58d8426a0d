"""Published Qwen3.5 text sizes as transformers `Qwen3_5TextConfig` fields (`preset_config` goes
through the importer's field checks). qwen3.5-9b is transformers' own default configuration,
which its documentation names the Qwen3.5-9B shape (32 layers, three Gated DeltaNet layers per
gated-attention layer)."""
from __future__ import annotations

PRESETS = {
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
    if name not in PRESETS:
        raise ValueError(f"--model {name}: not a Qwen3.5 preset; presets: {sorted(PRESETS)}")
    return config_from_hf(Qwen3_5TextConfig(**PRESETS[name]))
