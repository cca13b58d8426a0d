"""Nemotron-H <-> transformers for megazoo's trainable stack (the family folder's adapter): the
config through hf.py's checks (every field mapped, recorded, neutral or refused there), then a
`TransformerConfig` of single-mixer layers: "M" a "mamba2" mixer without MLP, "*" attention
without positions or MLP, "-" a squared-ReLU MLP without mixer (`token_mixers` "none"), "E"
megazoo's MoE layer without mixer (`layer_mlps` "moe": sigmoid routing with the correction bias
as `expert_bias`, group-limited top-k, squared-ReLU experts `experts.up_proj` / `down_proj` as
weight1 / weight2, the shared expert as `shared_expert`).
Each layer's one norm is `input_norm` before a mixer, `post_attention_norm` before an MLP.

Not carried through megazoo's config (so an export writes transformers' defaults for them):
the fields hf.py records only (time_step_max, expand, the MoE sizes, token ids, ...).
"""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import refuse
from ..language_model import WORD_EMBEDDINGS
from ..llama_like import fuse_qkv, split_qkv
from . import hf
from .model import NemotronHConfig

MIXERS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "none",
          "moe": "none"}
MLPS = {"linear_attention": "none", "full_attention": "none", "mlp": "dense", "moe": "moe"}


def config_from_hf(hf_cfg) -> TransformerConfig:
    """A TransformerConfig from a `transformers.NemotronHConfig` (every field checked)."""
    c = hf.config_from_hf(hf_cfg, moe=True)
    moe = hf.moe_fields(hf_cfg) if "moe" in c.layer_types else {}
    for name in ("attention_bias", "mlp_bias"):
        if getattr(c, name):
            raise refuse(hf.FAMILY, name, True, "False (not modelled in megazoo's layers)")
    return TransformerConfig(
        family="nemotron_h", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_layers=len(c.layer_types), num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size,
        max_position_embeddings=c.recorded.get("max_position_embeddings") or 4096,
        position_embedding="none", normalization="rmsnorm", layernorm_epsilon=c.layer_norm_epsilon,
        activation="relu2", bias=False, tie_word_embeddings=c.tie_word_embeddings,
        init_method_std=c.recorded.get("initializer_range") or 0.02, hidden_dropout=0.0,
        token_mixers=tuple(MIXERS[t] for t in c.layer_types),
        layer_mlps=tuple(MLPS[t] for t in c.layer_types), mamba_num_heads=c.mamba_num_heads,
        mamba_head_dim=c.mamba_head_dim, mamba_state_size=c.ssm_state_size,
        mamba_groups=c.n_groups, linear_conv_kernel=c.conv_kernel, linear_chunk_size=c.chunk_size,
        mamba_time_step_min=c.time_step_min, mamba_conv_bias=c.use_conv_bias,
        mamba_proj_bias=c.use_bias, **moe)


def _layer_types(config: TransformerConfig) -> tuple[str, ...]:
    kinds = {("mamba2", "none"): "linear_attention", ("attention", "none"): "full_attention",
             ("none", "dense"): "mlp", ("none", "moe"): "moe"}
    return tuple(kinds[m, p] for m, p in zip(config.token_mixers, config.layer_mlps))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.NemotronHConfig` of a megazoo Nemotron-H config (for export)."""
    if config.num_experts:
        extra = {**_moe_hf_fields(config), **extra}
    c = NemotronHConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        layer_types=_layer_types(config), num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        intermediate_size=config.ffn_hidden_size, mamba_num_heads=config.mamba_num_heads,
        mamba_head_dim=config.mamba_head_dim, ssm_state_size=config.mamba_state_size,
        n_groups=config.mamba_groups, conv_kernel=config.linear_conv_kernel,
        time_step_min=config.mamba_time_step_min, use_conv_bias=config.mamba_conv_bias,
        use_bias=config.mamba_proj_bias, layer_norm_epsilon=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings, chunk_size=config.linear_chunk_size,
        recorded={"max_position_embeddings": config.max_position_embeddings,
                  "initializer_range": config.init_method_std, **extra})
    return hf.hf_config(c)


def _moe_hf_fields(config: TransformerConfig) -> dict:
    """The HF MoE fields of megazoo's (the inverse of hf.moe_fields; refused where it cannot be)."""
    for what, bad in (("softmax routing", config.moe_router_score_function != "sigmoid"),
                      ("no expert bias", not config.moe_router_enable_expert_bias),
                      ("no shared expert", not config.moe_shared_expert_intermediate_size),
                      ("a gated shared expert", config.moe_shared_expert_gate),
                      ("a router bias", config.moe_router_bias)):
        if bad:
            raise ValueError(f"{hf.FAMILY} export: MoE layers with {what} have no transformers "
                             f"form (NemotronHTopkRouter: sigmoid, correction bias, shared MLP)")
    return dict(n_routed_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                norm_topk_prob=config.moe_norm_topk_prob,
                n_group=config.moe_router_num_groups or 1,
                topk_group=config.moe_router_group_topk or 1,
                routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0)


def _pairs(config: TransformerConfig):
    yield WORD_EMBEDDINGS, "model.embeddings.weight"
    yield "final_norm.weight", "model.norm_f.weight"
    if not config.tie_word_embeddings:
        yield "head_weight", "lm_head.weight"
    for i, kind in enumerate(_layer_types(config)):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        yield m + ("post_attention_norm" if kind in ("mlp", "moe") else "input_norm") + ".weight", \
            h + "norm.weight"
        x = h + "mixer."
        if kind == "linear_attention":
            names = [("in_proj.weight", "in_proj.weight"), ("conv_weight", "conv1d.weight"),
                     ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("D", "D"),
                     ("norm_weight", "norm.weight"), ("out_proj.weight", "out_proj.weight")]
            if config.mamba_conv_bias:
                names.append(("conv_bias", "conv1d.bias"))
            if config.mamba_proj_bias:
                names += [("in_proj.bias", "in_proj.bias"), ("out_proj.bias", "out_proj.bias")]
            for mz, name in names:
                yield m + "attention." + mz, x + name
        elif kind == "full_attention":
            yield m + "attention.dense.weight", x + "o_proj.weight"
        elif kind == "moe":  # experts stacked [E, out, in] in both (the files' form: from_hf_...)
            for mz, name in (("router", "gate.weight"), ("expert_bias", "gate.e_score_correction_bias"),
                             ("experts.weight1", "experts.up_proj"),
                             ("experts.weight2", "experts.down_proj"),
                             ("shared_expert.fc1.weight", "shared_experts.up_proj.weight"),
                             ("shared_expert.fc2.weight", "shared_experts.down_proj.weight")):
                yield m + "mlp." + mz, x + name
        else:
            yield m + "mlp.fc1.weight", x + "up_proj.weight"
            yield m + "mlp.fc2.weight", x + "down_proj.weight"


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """transformers' NemotronHForCausalLM tensors (or NVIDIA's `backbone.` names) -> megazoo's."""
    sd = hf.from_hf_state_dict(sd, NemotronHConfig(**_shape(config)))
    for i, kind in enumerate(_layer_types(config)):
        x = f"model.layers.{i}.mixer.experts."
        if kind == "moe" and x + "up_proj" not in sd:  # the files' per-expert tensors
            for proj in ("up_proj", "down_proj"):
                sd[x + proj] = torch.stack([sd[f"{x}{e}.{proj}.weight"]
                                            for e in range(config.num_experts)])
    out = {mz: sd[name] for mz, name in _pairs(config)}
    for i, kind in enumerate(_layer_types(config)):
        if kind == "full_attention":
            x = f"model.layers.{i}.mixer."
            out[f"layers.{i}.attention.qkv.weight"] = fuse_qkv(
                sd[x + "q_proj.weight"], sd[x + "k_proj.weight"], sd[x + "v_proj.weight"],
                config.num_query_groups)
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> transformers' NemotronHForCausalLM tensors."""
    out = {name: full[mz] for mz, name in _pairs(config)}
    for i, kind in enumerate(_layer_types(config)):
        if kind == "full_attention":
            x = f"model.layers.{i}.mixer."
            q, k, v = split_qkv(full[f"layers.{i}.attention.qkv.weight"], config)
            out[x + "q_proj.weight"], out[x + "k_proj.weight"], out[x + "v_proj.weight"] = q, k, v
    return {k: v.contiguous() for k, v in out.items()}


def _shape(config: TransformerConfig) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                layer_types=_layer_types(config), num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
                intermediate_size=config.ffn_hidden_size, mamba_num_heads=config.mamba_num_heads,
                mamba_head_dim=config.mamba_head_dim, ssm_state_size=config.mamba_state_size,
                n_groups=config.mamba_groups, tie_word_embeddings=config.tie_word_embeddings)
