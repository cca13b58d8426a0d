"""Qwen3.5-MoE text <-> transformers (`Qwen3_5MoeTextConfig`, `Qwen3_5MoeForCausalLM`) for
megazoo's trainable stack.

Config: Qwen3.5's fields go through models/qwen3_5/hf.py's checks (the same mapped, neutral and
fixed fields, less `intermediate_size`: there is no dense MLP), the sparse block's through
models/qwen35_moe_like.py. transformers' Qwen3.5-MoE has no `decoder_sparse_step` or
`norm_topk_prob` (every layer sparse, the top-k always renormalised): a config.json carrying
them, or a released text_config's `mlp_only_layers`, is accepted at that value (1, true, [])
and refused at any other, since transformers ignores them. A release's config (`Qwen3_5MoeConfig`,
model_type qwen3_5_moe) is read through its text_config, the vision config left out (logged).

Tensors: Qwen3.5's names for the layers (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: no fused
projections as in Qwen3-Next; models/qwen35_like.py), the sparse block's as Qwen3-Next's
(models/qwen35_moe_like.py): experts read from the files' per-expert tensors
(`experts.{e}.gate_proj` ..., what transformers' `save_pretrained` writes) or transformers'
in-memory stacked form (`experts.gate_up_proj` [E, 2f, h], `experts.down_proj` [E, h, f]),
written stacked (transformers loads both). A release's
`model.language_model.*` is renamed `model.*`; its vision tower and multi-token-prediction
head (`model.visual.*`, `mtp.*`) are left out with one logged line, as transformers'
`Qwen3_5MoeForCausalLM` leaves them. Export writes the text model (`Qwen3_5MoeForCausalLM`).
"""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..qwen3_5 import hf as qwen35
from ..qwen3_5.model import Qwen35Config
from ..qwen35_like import layers_from_hf, layers_to_hf, standalone_fields, transformer_fields
from ..qwen35_moe_like import moe_config_fields, moe_from_hf, moe_hf_fields, moe_to_hf

FAMILY = "Qwen3.5-MoE"
RELEASE = "qwen3_5_moe"  # the vision-language wrapper's model_type
MOE = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "router_aux_loss_coef"})
# output_router_logits only adds transformers' own aux loss to its loss; the logits are the same
MAPPED = (qwen35.MAPPED - {"intermediate_size"}) | MOE | {"output_router_logits"}
# Qwen3-Next's switches that transformers' Qwen3.5-MoE has fixed (a config.json may carry them):
# every layer sparse, the top-k renormalised; Qwen3.5's (gated attention, mlp_only_layers [])
FIXED = {**qwen35.FIXED, "decoder_sparse_step": 1, "norm_topk_prob": True}


def config_from_hf(hf_cfg) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Qwen3_5MoeTextConfig` (every field checked), or
    from a release's `Qwen3_5MoeConfig` (its text_config)."""
    if hasattr(hf_cfg, "text_config"):
        hf_cfg = qwen35.text_config_of(hf_cfg, RELEASE, FAMILY)
    check_fields(hf_cfg, FAMILY, MAPPED, qwen35.IGNORED, FIXED)
    if hf_cfg.router_aux_loss_coef and hf_cfg.output_router_logits:
        raise refuse(FAMILY, "output_router_logits", True,
                     "False (transformers' auxiliary loss is not what megazoo trains with)")
    c = qwen35.base_config(hf_cfg, FAMILY, intermediate_size=hf_cfg.moe_intermediate_size)
    moe = moe_config_fields(FAMILY, num_experts=hf_cfg.num_experts,
                            topk=hf_cfg.num_experts_per_tok, size=hf_cfg.moe_intermediate_size,
                            shared=hf_cfg.shared_expert_intermediate_size, norm_topk_prob=True,
                            aux_loss_coef=hf_cfg.router_aux_loss_coef)
    return TransformerConfig(**transformer_fields(c, "qwen3_5_moe_text", FAMILY), **moe)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Qwen3_5MoeTextConfig` of a megazoo Qwen3.5-MoE config (for export)."""
    from transformers import Qwen3_5MoeTextConfig
    if not config.moe_shared_expert_intermediate_size:
        raise ValueError("HF Qwen3.5-MoE cannot express no shared expert "
                         "(--moe-shared-expert-intermediate-size 0); export another family")
    fields = qwen35.hf_fields(Qwen35Config(**standalone_fields(config)))
    del fields["intermediate_size"]  # no dense MLP: transformers' config has no such field
    fields["architectures"] = ["Qwen3_5MoeForCausalLM"]
    return Qwen3_5MoeTextConfig(**{**fields, **moe_hf_fields(config), **extra})


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """transformers' Qwen3_5MoeForCausalLM tensors (or a release's) -> full megazoo tensors."""
    sd = qwen35.release_text_tensors(sd, FAMILY)
    out = {**layers_from_hf(sd, config), **moe_from_hf(sd, config)}
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> transformers' Qwen3_5MoeForCausalLM tensors (no lm_head when tied)."""
    out = {**layers_to_hf(full, config), **moe_to_hf(full, config)}
    return {k: v.contiguous() for k, v in out.items()}
