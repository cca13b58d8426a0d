"""Published Nemotron-H sizes as transformers `NemotronHConfig` fields (`preset_config` turns one
into a megazoo config through the importer, so a preset passes the same field checks as a
downloaded config.json). Shapes from NVIDIA's releases (Nemotron-H-4B/8B-Base-8K: 52 layers, the
pattern below; the 8B's in_proj of 18560 rows = 2 x 8192 + 2 x 8 x 128 + 128 pins heads, groups
and state). The 47B and 56B (Nemotron-H-47B/56B-Base-8K) as NVIDIA's Megatron-Bridge providers
give them: 98 and 118 layers of hidden 8192, 64 query heads of 128 in 8 groups, 256 Mamba heads
of 64 with state 256 in 8 groups, MLP 30720 / 32768; the 56B's pattern has the 54 Mamba-2, 54 MLP
and 10 attention layers of its model card."""
from __future__ import annotations

PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

PATTERN_98 = ("M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---"
              "M-M*-M-M-M-M-M-")
PATTERN_118 = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*"
               "-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
_LARGE = dict(vocab_size=131072, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
              head_dim=128, mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256, n_groups=8,
              conv_kernel=4, chunk_size=128, max_position_embeddings=8192)

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
    "nemotron-h-47b": dict(_LARGE, hybrid_override_pattern=PATTERN_98, intermediate_size=30720),
    "nemotron-h-56b": dict(_LARGE, hybrid_override_pattern=PATTERN_118, intermediate_size=32768),
}


def preset_config(name: str):
    """The megazoo NemotronHConfig of a preset."""
    from transformers import NemotronHConfig

    from .hf import config_from_hf
    if name not in PRESETS:
        raise ValueError(f"--model {name}: not a Nemotron-H preset; presets: {sorted(PRESETS)}")
    return config_from_hf(NemotronHConfig(**PRESETS[name]))
