"""The planner's parameter terms beyond `TransformerConfig`'s per-layer counts: the multi-token
prediction modules and the frozen router expert biases (training/planning/memory.py adds them to
a rank's count), and LoRA's adapters (the only trained parameters when the base is frozen).

Multi-token prediction (DeepSeek-V3, `mtp_num_layers` D): each of the D modules is an RMSNorm of
the hidden state (hnorm) and one of the next token's embedding (enorm), a projection of their
concatenation eh_proj [h, 2h] (no bias, split over TP by its output like a column-parallel
linear), one transformer layer numbered after the model's (MoE in DeepSeek-V3), and a final norm;
the word embedding and the head are the main model's, shared, so not counted again. The modules
sit on the last pipeline stage, where the head is.

The router expert bias (`moe_router_enable_expert_bias`, HF's `e_score_correction_bias`) is a
parameter of E fp32 numbers per MoE layer that trains without gradients (models/moe.py): the
model holds it whole on every rank, the optimizer never does, so it counts in the parameters a
rank holds but not in the ZeRO model states.
"""
from __future__ import annotations

from megazoo.models import lora_targets as lt
from megazoo.models.config import TransformerConfig


def mtp_layers(cfg: TransformerConfig) -> int:
    """The multi-token prediction depth D."""
    return cfg.mtp_num_layers


def mtp_parameters(cfg: TransformerConfig, tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(dense, routed-expert) parameters of the D multi-token prediction modules one (TP, EP)
    rank of the last stage holds (the model config's count, split)."""
    expert = sum(cfg.expert_parameters(cfg.num_layers + k, ep) for k in range(cfg.mtp_num_layers))
    return cfg.mtp_parameters(tp, ep) - expert, expert


def expert_bias_parameters(cfg: TransformerConfig, layers) -> int:
    """Frozen router expert-bias numbers of the global `layers` (and their MTP copies when
    `layers` holds the model's last layer)."""
    if not cfg.num_experts or not cfg.moe_router_enable_expert_bias:
        return 0
    layers = list(layers)
    moe = sum(map(cfg.is_moe_layer, layers))
    if cfg.num_layers - 1 in layers:  # the depths sit with the last layer
        moe += sum(cfg.is_moe_layer(cfg.num_layers + k) for k in range(cfg.mtp_num_layers))
    return moe * cfg.num_experts


def total_parameters(cfg: TransformerConfig) -> float:
    """Every parameter of the model as built unsharded and unpadded: `num_parameters` plus the
    multi-token prediction modules and the frozen expert biases (a released checkpoint's count,
    less the copies of the shared embedding and head it stores with each MTP module)."""
    return cfg.num_parameters() + sum(mtp_parameters(cfg)) + \
        expert_bias_parameters(cfg, range(cfg.num_layers))


def lora_parameters(cfg: TransformerConfig, lora, tp: int, layers) -> int:
    """LoRA adapter parameters one TP rank holds for the global `layers` (`lora`: the run's
    LoRASettings): per target, A [r, in] and B [out, r], B split over TP with a column-parallel
    base, A with a row-parallel one (parallel/lora.py)."""
    per_layer = 0
    for target, module, _ in lt.sites(cfg.family, lora.targets):
        parts, _, fan_in = lt.module_parts(cfg, module)
        rows = dict(parts)[target]
        if module in lt.ROW_PARALLEL:
            per_layer += lora.rank * (fan_in // tp + rows)
        else:
            per_layer += lora.rank * (fan_in + rows // tp)
    return per_layer * len(list(layers))
