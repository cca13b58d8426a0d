"""Published Nemotron-H sizes as transformers `NemotronHConfig` fields (`preset_config` turns one
into a megazoo config through the importer, so a preset passes the same field checks as a
downloaded config.json). Shapes from NVIDIA's releases (Nemotron-H-4B/8B-Base-8K: 52 layers, the
pattern below; the 8B's in_proj of 18560 rows = 2 x 8192 + 2 x 8 x 128 + 128 pins heads, groups
and state)."""
from __future__ import annotations

PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

PRESETS = {
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
}


def preset_config(name: str):
    """The megazoo NemotronHConfig of a preset."""
    from transformers import NemotronHConfig

    from .hf import config_from_hf
    if name not in PRESETS:
        raise ValueError(f"--model {name}: not a Nemotron-H preset; presets: {sorted(PRESETS)}")
    return config_from_hf(NemotronHConfig(**PRESETS[name]))
