"""Nemotron-H (`NemotronHForCausalLM`, model_type nemotron_h) to and from transformers: every
config.json field mapped, recorded (read by transformers only to initialise weights, or not at
all: written back unchanged), neutral (models/hf_fields.py) or refused in one line; tensors keep
transformers' names, so export is bit-identical to the import.

transformers' Mamba-2 clamps dt to (time_step_min, inf) and never reads time_step_limit; megazoo
computes the same. Multi-token prediction is refused (not modelled). MoE layers ("E") are
modelled by megazoo's trainable stack only (adapter.py reads their fields with `moe_fields`);
this single-device model refuses them.
"""
from __future__ import annotations

import torch

from ..hf_fields import check_fields, refuse
from .model import LAYER_TYPES, NemotronHConfig

FAMILY = "Nemotron-H"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "layers_block_type", "tie_word_embeddings", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_bias", "attention_dropout", "sliding_window",
    "intermediate_size", "mlp_hidden_act", "mlp_bias", "ssm_state_size", "mamba_num_heads",
    "mamba_head_dim", "mamba_hidden_act", "n_groups", "conv_kernel", "time_step_min",
    "use_conv_bias", "chunk_size", "use_bias", "layer_norm_epsilon", "hidden_dropout",
    "num_nextn_predict_layers"})
# read by transformers for initialisation or generation only, or not read: kept and written back
RECORDED = ("max_position_embeddings", "use_mamba_kernels", "expand", "time_step_max",
            "time_step_limit", "time_step_floor", "mamba_proj_bias", "mamba_ssm_cache_dtype",
            "num_logits_to_keep", "initializer_range", "residual_in_fp32", "rescale_prenorm_residual",
            "mtp_layers_block_type", "n_routed_experts", "output_router_logits", "n_shared_experts",
            "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
            "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group",
            "topk_group", "norm_topk_prob", "bos_token_id", "eos_token_id", "pad_token_id")
# time_step_rank (a Mamba-1 size) and the RoPE fields of NVIDIA's own code: transformers' Mamba-2
# and position-free attention read none of them
IGNORED = frozenset(RECORDED) | {"is_encoder_decoder", "time_step_rank", "rope_theta",
                                 "partial_rotary_factor"}
# other names NVIDIA's released files give head_dim and the norms' epsilon (transformers reads
# head_dim and layer_norm_epsilon only): accepted where they agree with those
FIXED = {"attention_head_dim": lambda hf: hf.head_dim,
         "rms_norm_eps": lambda hf: hf.layer_norm_epsilon,
         "norm_eps": lambda hf: hf.layer_norm_epsilon}


def moe_fields(hf) -> dict:
    """megazoo's MoE config fields of an HF config with "moe" layers: sigmoid routing with the
    correction bias (megazoo's expert bias), group-limited top-k, renormalised, scaled;
    squared-ReLU experts without a gate and one shared squared-ReLU MLP."""
    for name, value, want in (("moe_latent_size", hf.moe_latent_size, None),
                              ("mlp_hidden_act", hf.mlp_hidden_act, "relu2")):
        if value != want:
            raise refuse(FAMILY, name, value, want)
    if not hf.moe_shared_expert_intermediate_size:
        raise refuse(FAMILY, "moe_shared_expert_intermediate_size",
                     hf.moe_shared_expert_intermediate_size, ">= 1 (transformers always builds one)")
    if hf.n_routed_experts % hf.n_group or not 1 <= hf.topk_group <= hf.n_group:
        raise refuse(FAMILY, "n_group", (hf.n_group, hf.topk_group),
                     "n_group dividing n_routed_experts, 1 <= topk_group <= n_group")
    grouped = hf.n_group > 1
    return dict(num_experts=hf.n_routed_experts, moe_router_topk=hf.num_experts_per_tok,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_shared_expert_intermediate_size=hf.moe_shared_expert_intermediate_size,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_norm_topk_prob=bool(hf.norm_topk_prob),
                moe_router_num_groups=hf.n_group if grouped else None,
                moe_router_group_topk=hf.topk_group if grouped else None,
                moe_router_topk_scaling_factor=float(hf.routed_scaling_factor))


def config_from_hf(hf, moe: bool = False) -> NemotronHConfig:
    """A NemotronHConfig from a `transformers.NemotronHConfig` (every field checked). `moe`:
    the caller models "moe" layers itself (adapter.py); else they are refused."""
    check_fields(hf, FAMILY, MAPPED, IGNORED, FIXED)
    types = list(hf.layers_block_type)
    if "moe" in types and not moe:
        raise refuse(FAMILY, "layers_block_type", "'moe' (E) layers in the single-device model",
                     f"{list(LAYER_TYPES)}; megazoo's trainable stack (the registry's "
                     f"adapter) models them")
    for name, value, want in (("mlp_hidden_act", hf.mlp_hidden_act, "relu2"),
                              ("mamba_hidden_act", hf.mamba_hidden_act, "silu"),
                              ("sliding_window", hf.sliding_window, None),
                              ("attention_dropout", hf.attention_dropout, 0.0),
                              ("hidden_dropout", hf.hidden_dropout, 0.0),
                              ("num_nextn_predict_layers", hf.num_nextn_predict_layers, 0)):
        if value != want:
            raise refuse(FAMILY, name, value, want)
    if hf.mamba_num_heads % hf.n_groups:
        raise refuse(FAMILY, "n_groups", hf.n_groups, f"a divisor of mamba_num_heads ({hf.mamba_num_heads})")
    return NemotronHConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, layer_types=tuple(types),
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim, intermediate_size=hf.intermediate_size,
        mamba_num_heads=hf.mamba_num_heads, mamba_head_dim=hf.mamba_head_dim,
        ssm_state_size=hf.ssm_state_size, n_groups=hf.n_groups, conv_kernel=hf.conv_kernel,
        time_step_min=float(hf.time_step_min), use_conv_bias=bool(hf.use_conv_bias),
        use_bias=bool(hf.use_bias), mlp_bias=bool(hf.mlp_bias),
        attention_bias=bool(hf.attention_bias), layer_norm_epsilon=hf.layer_norm_epsilon,
        tie_word_embeddings=bool(hf.tie_word_embeddings), chunk_size=hf.chunk_size,
        recorded={k: getattr(hf, k) for k in RECORDED})


def hf_config(c: NemotronHConfig):
    """The `transformers.NemotronHConfig` of `c` (export)."""
    from transformers import NemotronHConfig as HFConfig
    return HFConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, layers_block_type=list(c.layer_types),
        tie_word_embeddings=c.tie_word_embeddings, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        attention_bias=c.attention_bias, attention_dropout=0.0, sliding_window=None,
        intermediate_size=c.intermediate_size, mlp_hidden_act="relu2", mlp_bias=c.mlp_bias,
        ssm_state_size=c.ssm_state_size, mamba_num_heads=c.mamba_num_heads,
        mamba_head_dim=c.mamba_head_dim, mamba_hidden_act="silu", n_groups=c.n_groups,
        conv_kernel=c.conv_kernel, time_step_min=c.time_step_min, use_conv_bias=c.use_conv_bias,
        chunk_size=c.chunk_size, use_bias=c.use_bias, layer_norm_epsilon=c.layer_norm_epsilon,
        hidden_dropout=0.0, num_nextn_predict_layers=0, architectures=["NemotronHForCausalLM"],
        **c.recorded)


def from_hf_state_dict(state: dict[str, torch.Tensor], c: NemotronHConfig) -> dict[str, torch.Tensor]:
    # NVIDIA's released files name the trunk `backbone.`; transformers renames it `model.` on
    # load (its checkpoint conversion mapping for nemotron_h), and so does this import
    out = {("model." + k[len("backbone."):]) if k.startswith("backbone.") else k: v
           for k, v in state.items()}
    if c.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], c: NemotronHConfig) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
