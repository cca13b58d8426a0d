"""The hybrid stacks' TransformerConfig fields (docs/hybrid.md): each set exactly when a layer
kind reads it (`check_hybrid`, from TransformerConfig.__post_init__), and the layouts the linear
mixers take (`check_hybrid_layout`, from TransformerConfig.check_layout). Reads fields only."""
from __future__ import annotations

from megazoo.parallel.errors import LayoutError

from .spec import MLP_KINDS, lookup


def check_hybrid(config) -> None:
    """The hybrid stacks' fields: set exactly when a layer kind reads them."""
    kinds = set(config.token_mixers or ())
    if config.layer_mlps is not None:
        config.layer_mlps = tuple(config.layer_mlps)
        if len(config.layer_mlps) != config.num_layers or config.token_mixers is None:
            raise ValueError(f"layer_mlps names {len(config.layer_mlps)} layers; it needs "
                             f"token_mixers and one entry per layer ({config.num_layers})")
        for kind in config.layer_mlps:
            lookup(dict.fromkeys(MLP_KINDS), kind, "MLP kind (layer_mlps)")
            if kind == "dense_moe":
                raise ValueError("layer_mlps: 'dense_moe' layers are set by moe_with_dense_mlp "
                                 "on the MoE layers; name them 'moe'")
        if "moe" in config.layer_mlps and not config.num_experts:
            raise ValueError("layer_mlps names 'moe' layers: set num_experts")
    rope_attention = config.position_embedding == "rope" and not config.kv_lora_rank and (
        not kinds or "attention" in kinds)  # plain attention layers with RoPE take it too
    used = {"rotary_fraction": "gated_attention" in kinds or rope_attention,
            "linear_num_key_heads": "gated_deltanet" in kinds,
            "mamba_num_heads": "mamba2" in kinds}
    groups = {"linear_num_key_heads": ("linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"),
              "mamba_num_heads": ("mamba_head_dim", "mamba_state_size", "mamba_groups")}
    for lead, needed in used.items():
        if lead == "rotary_fraction":
            if not needed and config.rotary_fraction != 1.0:
                raise ValueError("rotary_fraction applies to RoPE attention and gated_attention "
                                 "layers only; drop it")
            if not 0 < config.rotary_fraction <= 1 or (
                    round(config.head_dim * config.rotary_fraction) % 2):
                raise ValueError(f"rotary_fraction {config.rotary_fraction} must be in (0, 1] "
                                 f"and rotate an even number of head_dim's channels")
            continue
        names = (lead,) + groups[lead]
        values = [getattr(config, n) for n in names]
        if needed and any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"token_mixers names {lead.split('_')[0]} layers: set "
                             f"{', '.join(names)} (integers >= 1), got {values}")
        if not needed and any(v is not None for v in values):
            raise ValueError(f"{', '.join(names)} apply to "
                             f"{'gated_deltanet' if lead.startswith('linear') else 'mamba2'} "
                             f"layers only; drop them or name such layers in token_mixers")
    if "gated_deltanet" in kinds and config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads {config.linear_num_value_heads} must be a "
                         f"multiple of linear_num_key_heads {config.linear_num_key_heads}")
    if "mamba2" in kinds and config.mamba_num_heads % config.mamba_groups:
        raise ValueError(f"mamba_num_heads {config.mamba_num_heads} must be a multiple of "
                         f"mamba_groups {config.mamba_groups}")


def check_hybrid_layout(config, parallel) -> None:
    """Refuse a tensor-parallel size that does not divide the linear mixers' heads or groups."""
    kinds = set(config.token_mixers or ())
    sizes = {}  # the linear mixers' head counts TP splits (models/linear_mixers.py)
    if "gated_deltanet" in kinds:
        sizes.update(linear_num_key_heads=config.linear_num_key_heads,
                     linear_num_value_heads=config.linear_num_value_heads)
    if "mamba2" in kinds:
        sizes.update(mamba_num_heads=config.mamba_num_heads, mamba_groups=config.mamba_groups)
    for name, n in sizes.items():
        if n % parallel.tp:
            raise LayoutError(f"--tensor-model-parallel-size {parallel.tp} does not divide the "
                              f"linear layers' {name} ({n}); pick a tp that divides it")
