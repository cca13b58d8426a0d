"""Qwen3-Next <-> transformers for megazoo's trainable stack (the family folder's adapter): the
config through hf.py's checks, then Qwen3.5's layers (models/qwen35_like.py) with megazoo's
mixture of experts on the sparse layers (`layer_mlps`: "moe" where transformers puts experts,
"dense" on `mlp_only_layers` and off-step layers): the top-k of the softmax router
(`moe_router_pre_softmax`, renormalised with `norm_topk_prob`), SwiGLU experts, the shared
expert scaled by sigmoid(shared_expert_gate) (the block Qwen3.5-MoE shares:
models/qwen35_moe_like.py, which maps its fields and tensors). Tensors: hf.py splits the linear
layers' fused projections into Qwen3.5's names, the Qwen3.5 adapter renames those, the MoE
tensors are mapped by models/qwen35_moe_like.py (router, stacked experts, shared expert and its
gate).
"""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..qwen35_like import layers_from_hf, layers_to_hf, standalone_fields, transformer_fields
from ..qwen35_moe_like import moe_config_fields, moe_from_hf, moe_hf_fields, moe_to_hf
from . import hf
from .model import Qwen3NextConfig


def config_from_hf(hf_cfg) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3NextConfig` (every field checked)."""
    c = hf.config_from_hf(hf_cfg)
    moe = moe_config_fields(hf.FAMILY, num_experts=c.num_experts, topk=c.num_experts_per_tok,
                            size=c.moe_intermediate_size, shared=c.shared_expert_intermediate_size,
                            norm_topk_prob=c.norm_topk_prob,
                            aux_loss_coef=c.extra.get("router_aux_loss_coef"))
    mlps = tuple("moe" if c.is_moe_layer(i) else "dense" for i in range(len(c.layer_types)))
    return TransformerConfig(
        **transformer_fields(c, "qwen3_next", hf.FAMILY),
        layer_mlps=None if set(mlps) == {"moe"} else mlps,  # None: every layer's MLP sparse
        **moe)


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
    cfg.router_aux_loss_coef = moe_hf_fields(config)["router_aux_loss_coef"]
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """transformers' Qwen3NextForCausalLM tensors -> full megazoo tensors."""
    sd = hf.from_hf_state_dict(sd, _standalone(config))
    out = {**layers_from_hf(sd, config), **moe_from_hf(sd, config)}
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> transformers' Qwen3NextForCausalLM tensors."""
    out = {**layers_to_hf(full, config), **moe_to_hf(full, config)}
    standalone = _standalone(config)
    # the linear layers' projections fused back as transformers stores them (in_proj_qkvz, _ba)
    out = hf.to_hf_state_dict(out, standalone)
    return {k: v.contiguous() for k, v in out.items()}
