"""Qwen3-Next <-> transformers for megazoo's trainable stack (the family folder's adapter): the
config through hf.py's checks, then Qwen3.5's layers (models/qwen35_like.py) with megazoo's
mixture of experts on the sparse layers (`layer_mlps`: "moe" where transformers puts experts,
"dense" on `mlp_only_layers` and off-step layers): the top-k of the softmax router
(`moe_router_pre_softmax`, renormalised with `norm_topk_prob`), SwiGLU experts, the shared
expert scaled by sigmoid(shared_expert_gate). Tensors: hf.py splits the linear layers' fused
projections into Qwen3.5's names, the Qwen3.5 adapter renames those, the MoE tensors are
mapped here (router, stacked experts, shared expert and its gate).
"""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import refuse
from ..qwen_moe_like import shared_expert_from_hf, shared_expert_to_hf, stacked_experts
from ..qwen35_like import layers_from_hf, layers_to_hf, standalone_fields, transformer_fields
from . import hf
from .model import Qwen3NextConfig


def config_from_hf(hf_cfg) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3NextConfig` (every field checked)."""
    c = hf.config_from_hf(hf_cfg)
    if not c.num_experts or not c.shared_expert_intermediate_size:
        raise refuse(hf.FAMILY, "num_experts / shared_expert_intermediate_size",
                     (c.num_experts, c.shared_expert_intermediate_size),
                     "both > 0 (megazoo's Qwen3-Next has sparse layers with a shared expert)")
    mlps = tuple("moe" if c.is_moe_layer(i) else "dense" for i in range(len(c.layer_types)))
    return TransformerConfig(
        **transformer_fields(c, "qwen3_next", hf.FAMILY),
        layer_mlps=None if set(mlps) == {"moe"} else mlps,  # None: every layer's MLP sparse
        num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_pre_softmax=True,
        moe_norm_topk_prob=bool(c.norm_topk_prob),
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=float(c.extra.get("router_aux_loss_coef") or 0.0))


def _standalone(config: TransformerConfig) -> Qwen3NextConfig:
    mlps = config.layer_mlps or ("moe",) * config.num_layers
    return Qwen3NextConfig(
        **standalone_fields(config), num_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        norm_topk_prob=config.moe_norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=tuple(i for i, k in enumerate(mlps) if k != "moe"))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen3NextConfig` of a megazoo Qwen3-Next config (for export)."""
    cfg = hf.hf_config(_standalone(config))
    cfg.router_aux_loss_coef = config.moe_aux_loss_coeff
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def _moe_layers(config: TransformerConfig):
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            yield f"layers.{i}.mlp.", f"model.layers.{i}.mlp."


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """transformers' Qwen3NextForCausalLM tensors -> full megazoo tensors."""
    sd = hf.from_hf_state_dict(sd, _standalone(config))
    out = layers_from_hf(sd, config)
    for m, h in _moe_layers(config):
        out[m + "router"] = sd[h + "gate.weight"]
        # transformers' in-memory 3-D form, or the files' per-expert tensors
        out[m + "experts.weight1"], out[m + "experts.weight2"] = stacked_experts(
            sd, h, config.num_experts)
        out.update(shared_expert_from_hf(sd, m, h))
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> transformers' Qwen3NextForCausalLM tensors."""
    out = layers_to_hf(full, config)
    for m, h in _moe_layers(config):
        out[h + "gate.weight"] = full[m + "router"]
        out[h + "experts.gate_up_proj"] = full[m + "experts.weight1"]
        out[h + "experts.down_proj"] = full[m + "experts.weight2"]
        out.update(shared_expert_to_hf(full, m, h))
    standalone = _standalone(config)
    # the linear layers' projections fused back as transformers stores them (in_proj_qkvz, _ba)
    out = hf.to_hf_state_dict(out, standalone)
    return {k: v.contiguous() for k, v in out.items()}
