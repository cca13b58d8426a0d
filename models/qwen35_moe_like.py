"""The sparse MLP Qwen3-Next and Qwen3.5-MoE share (transformers' `Qwen3NextSparseMoeBlock`,
which `Qwen3_5MoeSparseMoeBlock` is), shared by both family folders: its config fields and its
tensors.

A softmax router over all experts, the top-k (renormalised where `norm_topk_prob`; Qwen3.5-MoE's
router always renormalises), SwiGLU experts, and a shared SwiGLU expert scaled by
sigmoid(`shared_expert_gate`) added to every token's output. In megazoo terms:
`moe_router_pre_softmax`, `moe_norm_topk_prob`, `moe_shared_expert_intermediate_size` with
`moe_shared_expert_gate`. transformers' `router_aux_loss_coef` multiplies a load-balancing sum
that is top-k times megazoo's (Megatron's), as for the Qwen-MoE families (models/qwen_moe_like.py).

Tensors, per sparse layer (HF `model.layers.{i}.mlp.` -> megazoo `layers.{i}.mlp.`):

    gate.weight [E, h]                        -> router
    experts.gate_up_proj [E, 2f, h] ([gate; up]), or a file's experts.{e}.{gate,up}_proj
                                              -> experts.weight1
    experts.down_proj [E, h, f], or experts.{e}.down_proj -> experts.weight2
    shared_expert.{gate,up,down}_proj, shared_expert_gate -> shared_expert.fc1 / fc2, shared_expert_gate

Export writes transformers' in-memory stacked form, which its loader reads as it is (its
`save_pretrained` writes each expert apart; both import).
"""
from __future__ import annotations

import torch

from .config import TransformerConfig
from .hf_fields import refuse
from .qwen_moe_like import shared_expert_from_hf, shared_expert_to_hf, stacked_experts


def moe_config_fields(family: str, *, num_experts: int, topk: int, size: int, shared: int,
                      norm_topk_prob: bool, aux_loss_coef: float | None) -> dict:
    """The TransformerConfig MoE fields of the block (`family` names it in a refusal)."""
    if not num_experts or not shared:
        raise refuse(family, "num_experts / shared_expert_intermediate_size",
                     (num_experts, shared),
                     f"both > 0 (megazoo's {family} has sparse layers with a shared expert)")
    if topk > num_experts:
        raise refuse(family, "num_experts_per_tok", topk, f"<= num_experts ({num_experts})")
    return dict(num_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=size,
                moe_router_pre_softmax=True, moe_norm_topk_prob=bool(norm_topk_prob),
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True,
                moe_aux_loss_coeff=float(aux_loss_coef or 0.0) * topk)


def moe_hf_fields(config: TransformerConfig) -> dict:
    """The HF fields of the block (the inverse of `moe_config_fields`)."""
    return dict(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                router_aux_loss_coef=config.moe_aux_loss_coeff / config.moe_router_topk)


def _moe_layers(config: TransformerConfig):
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            yield f"layers.{i}.mlp.", f"model.layers.{i}.mlp."


def moe_from_hf(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """The sparse layers' megazoo tensors from HF names (the stacked or the per-expert form)."""
    out = {}
    for m, h in _moe_layers(config):
        out[m + "router"] = sd[h + "gate.weight"]
        out[m + "experts.weight1"], out[m + "experts.weight2"] = stacked_experts(
            sd, h, config.num_experts)
        out.update(shared_expert_from_hf(sd, m, h))
    return out


def moe_to_hf(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """The sparse layers' HF tensors (transformers' stacked experts) from megazoo's."""
    out = {}
    for m, h in _moe_layers(config):
        out[h + "gate.weight"] = full[m + "router"]
        out[h + "experts.gate_up_proj"] = full[m + "experts.weight1"]
        out[h + "experts.down_proj"] = full[m + "experts.weight2"]
        out.update(shared_expert_to_hf(full, m, h))
    return out
