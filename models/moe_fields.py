"""The mixture-of-experts fields of TransformerConfig (docs/moe.md), checked when num_experts is
set (`check_moe`, from TransformerConfig.__post_init__): the counts and coefficients in range and
the router's options consistent with each other, each refusal one line naming the flag or field.
Sets one default: the experts' width (--moe-ffn-hidden-size) is ffn_hidden_size unless given."""
from __future__ import annotations


def check_moe(config) -> None:
    """The MoE fields (set when num_experts is): the expert MLP's width defaulted, every count and
    coefficient in range, the router's options consistent (`_check_router`)."""
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    for flag, value in (("--num-experts", config.num_experts),
                        ("--moe-router-topk", config.moe_router_topk),
                        ("--moe-layer-freq", config.moe_layer_freq),
                        ("--moe-ffn-hidden-size", config.moe_ffn_hidden_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    if config.moe_router_topk > config.num_experts:
        raise ValueError(f"--moe-router-topk {config.moe_router_topk} exceeds --num-experts "
                         f"{config.num_experts}")
    if config.moe_expert_capacity_factor is not None and config.moe_expert_capacity_factor <= 0:
        raise ValueError(f"--moe-expert-capacity-factor must be > 0 (omit it for dropless "
                         f"routing), got {config.moe_expert_capacity_factor}")
    if config.moe_aux_loss_coeff < 0 or config.moe_z_loss_coeff < 0:
        raise ValueError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    _check_router(config)
    if not isinstance(config.moe_first_dense_layers, int) or config.moe_first_dense_layers < 0:
        raise ValueError(f"moe_first_dense_layers must be an integer >= 0, got "
                         f"{config.moe_first_dense_layers}")
    if config.moe_shared_expert_gate and not config.moe_shared_expert_intermediate_size:
        raise ValueError("moe_shared_expert_gate needs --moe-shared-expert-intermediate-size")


def _check_router(config) -> None:
    sigmoid = config.moe_router_score_function == "sigmoid"
    for name, value, allowed in (
            ("--moe-router-score-function", config.moe_router_score_function, ("softmax", "sigmoid")),
            ("--moe-router-load-balancing-type", config.moe_router_load_balancing_type,
             ("aux_loss", "seq_aux_loss"))):
        if value not in allowed:
            raise ValueError(f"{name} {value!r} is not supported; choose one of {allowed}")
    if config.moe_norm_topk_prob and not (config.moe_router_pre_softmax or sigmoid):
        raise ValueError("moe_norm_topk_prob applies to --moe-router-pre-softmax or "
                         "--moe-router-score-function sigmoid only (top-k then softmax is "
                         "normalised already)")
    if sigmoid and config.moe_router_pre_softmax:
        raise ValueError("--moe-router-pre-softmax applies to --moe-router-score-function "
                         "softmax only; drop one")
    if config.moe_router_enable_expert_bias and not sigmoid:
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if not config.moe_router_bias_update_rate >= 0:
        raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got "
                         f"{config.moe_router_bias_update_rate}")
    if config.moe_router_topk_scaling_factor is not None and not config.moe_router_topk_scaling_factor > 0:
        raise ValueError(f"--moe-router-topk-scaling-factor must be > 0, got "
                         f"{config.moe_router_topk_scaling_factor}")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together; "
                         "pass both or neither")
    if groups is None:
        return
    if not sigmoid:
        raise ValueError("--moe-router-num-groups needs --moe-router-score-function sigmoid "
                         "(group-limited routing is modelled as DeepSeek-V3's)")
    if groups < 1 or config.num_experts % groups or config.num_experts // groups < 2:
        raise ValueError(f"--moe-router-num-groups {groups} must divide --num-experts "
                         f"{config.num_experts} into groups of at least 2 experts (a group "
                         f"scores as its two best experts)")
    per_group = config.num_experts // groups
    if not 1 <= group_topk <= groups or config.moe_router_topk > group_topk * per_group:
        raise ValueError(f"--moe-router-group-topk {group_topk} must be in 1..{groups} and "
                         f"its groups hold --moe-router-topk {config.moe_router_topk} experts "
                         f"({per_group} per group)")
