"""Megatron-LM's mixture-of-experts runs (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3-style) for the
Megatron readers and writers: the recorded MoE args <-> megazoo's config fields, the per-layer
dense/MoE pattern, the layer offsets of uneven pipeline stages, and the legacy GroupedMLP tensors.

Routing, as megatron-core 0.16.1's `topk_routing_with_score_function` computes it:

    softmax, moe_router_pre_softmax   softmax over all experts, top-k, not renormalised
    softmax                           top-k logits, softmax over them (= the renormalised top-k)
    sigmoid                           sigmoid scores, top-k of scores + expert_bias (the bias
                                      steers the choice only), renormalised when topk > 1
    then                              times moe_router_topk_scaling_factor when set

Group-limited routing (`moe_router_num_groups`, `moe_router_group_topk`) keeps each token's best
groups, a group scored by the sum of its best topk // group_topk experts; megazoo's router
(models/moe.py) scores a group by its two best, under sigmoid scores, so other settings are
refused. `moe_layer_freq` is an int (layer i has experts when i % freq == 0) or Megatron-LM's
evaluated list ([0]*k + [1]*(L-k): DeepSeek-V3's first k dense layers); megazoo models "the first
k dense, then every freq-th", other patterns are refused naming the list.
"""
from __future__ import annotations

import logging
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.config.megatron_compat import moe_layer_freq

logger = logging.getLogger(__name__)

# Megatron-core buffers saved beside the parameters: weights, but no optimizer state
BUFFERS = re.compile(r".*\.mlp\.router\.expert_bias$")
# The legacy GroupedMLP (`--moe-grouped-gemm` without Transformer Engine): one tensor per weight
# and rank, weight1 [h, local experts * fc1 / tp], weight2 [local experts * ffn / tp, h]
_GROUPED = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])")


def _refuse(where: str, arg: str, value, why: str):
    raise ckpt.CheckpointError(f"{where}: args.{arg}={value!r}: {why}; megazoo cannot continue "
                               f"this model")


def layer_pattern(freq, num_layers: int, where: str) -> tuple[int, int]:
    """(moe_first_dense_layers, moe_layer_freq) of Megatron's `moe_layer_freq` (an int or the
    per-layer list of 0 dense / 1 MoE that Megatron-LM's --moe-layer-freq evaluates to; its
    unevaluated text, "[0]*3+[1]*58", is read as the command line's is)."""
    if isinstance(freq, str):
        try:
            text = freq.strip()  # Megatron-LM's examples write "([0]*3+[1]*58)"
            every, length, first = moe_layer_freq(text[1:-1] if text.startswith("(") and
                                                  text.endswith(")") else text)
        except ValueError as e:
            _refuse(where, "moe_layer_freq", freq, str(e))
        if length not in (None, num_layers):
            _refuse(where, "moe_layer_freq", freq, f"it lists {length} layers, the model has "
                    f"{num_layers}")
        return first, every
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        _refuse(where, "moe_layer_freq", freq, "megazoo reads an int or a list of 0/1 per layer")
    if isinstance(freq, int):
        return 0, freq
    pattern = [int(x) for x in freq]
    if len(pattern) != num_layers or set(pattern) - {0, 1} or 1 not in pattern:
        _refuse(where, "moe_layer_freq", freq, f"a pattern needs one 0 (dense) or 1 (MoE) per "
                f"layer ({num_layers}) and at least one MoE layer")
    first = pattern.index(1)
    for every in range(1, num_layers + 1):
        if pattern == [int(i >= first and i % every == 0) for i in range(num_layers)]:
            return first, every
    _refuse(where, "moe_layer_freq", freq, "megazoo models the first k layers dense and then "
            "every n-th layer MoE (moe_first_dense_layers, moe_layer_freq), not this pattern")


def _routing(args, where: str, topk: int) -> dict:
    score = getattr(args, "moe_router_score_function", None) or "softmax"
    if score not in ("softmax", "sigmoid"):
        _refuse(where, "moe_router_score_function", score, "megazoo routes by softmax or sigmoid")
    sigmoid = score == "sigmoid"
    balancing = getattr(args, "moe_router_load_balancing_type", None) or "aux_loss"
    if isinstance(balancing, (list, tuple)):
        if len(set(balancing)) != 1:
            _refuse(where, "moe_router_load_balancing_type", balancing, "several load-balancing "
                    "losses at once")
        balancing = balancing[0]
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        _refuse(where, "moe_router_load_balancing_type", balancing, "megazoo trains with aux_loss "
                "or seq_aux_loss (sinkhorn routes otherwise; global_aux_loss is not modelled)")
    groups, group_topk = (getattr(args, "moe_router_num_groups", None),
                          getattr(args, "moe_router_group_topk", None))
    if groups or group_topk:
        if not sigmoid:
            _refuse(where, "moe_router_num_groups", groups, "group-limited routing under softmax "
                    "scores (megazoo limits groups under sigmoid routing, as DeepSeek-V3)")
        if not group_topk or topk // group_topk != 2:
            _refuse(where, "moe_router_group_topk", group_topk, f"Megatron scores a group by its "
                    f"best moe_router_topk // moe_router_group_topk = "
                    f"{topk // group_topk if group_topk else '?'} experts, megazoo by its best 2")
    scale = getattr(args, "moe_router_topk_scaling_factor", None)
    rate = getattr(args, "moe_router_bias_update_rate", None)  # 0 turns the update off
    pre_softmax = bool(getattr(args, "moe_router_pre_softmax", False))
    return dict(moe_router_score_function=score,
                moe_router_pre_softmax=pre_softmax and not sigmoid,
                moe_norm_topk_prob=sigmoid and topk > 1,
                moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias",
                                                           False)),
                moe_router_bias_update_rate=1e-3 if rate is None else float(rate),
                moe_router_num_groups=groups or None, moe_router_group_topk=group_topk or None,
                moe_router_topk_scaling_factor=float(scale) if scale else None,
                moe_router_load_balancing_type="seq_aux_loss" if balancing == "seq_aux_loss"
                else "aux_loss", no_aux_loss=balancing == "none")


def config_fields(args, where: str) -> dict:
    """megazoo's MoE config fields of a Megatron-LM run with --num-experts."""
    router_dtype = getattr(args, "moe_router_dtype", None)
    if router_dtype and (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        logger.info("%s: args.moe_router_dtype=%s: megazoo computes the router's logits in the "
                    "model's dtype (its routing weights in fp32)", where, router_dtype)
    topk = int(args.moe_router_topk)
    first, freq = layer_pattern(getattr(args, "moe_layer_freq", None) or 1, args.num_layers, where)
    shared = getattr(args, "moe_shared_expert_intermediate_size", None)
    coeff = getattr(args, "moe_aux_loss_coeff", None) or 0.0
    if isinstance(coeff, (list, tuple)):
        coeff = coeff[0] if len(set(coeff)) == 1 else _refuse(
            where, "moe_aux_loss_coeff", coeff, "several load-balancing losses at once")
    _check_dispatch(args, where)
    routing = _routing(args, where, topk)
    if routing.pop("no_aux_loss"):  # Megatron's "none": no load-balancing loss at any coefficient
        coeff = 0.0
    return dict(num_experts=args.num_experts, moe_router_topk=topk,
                moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
                moe_aux_loss_coeff=float(coeff),
                moe_z_loss_coeff=float(getattr(args, "moe_z_loss_coeff", None) or 0.0),
                moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
                moe_layer_freq=freq, moe_first_dense_layers=first,
                moe_shared_expert_intermediate_size=shared or None,
                moe_shared_expert_gate=bool(shared and getattr(args, "moe_shared_expert_gate",
                                                               False)),
                **routing)


def _check_dispatch(args, where: str) -> None:
    """Token-dispatch settings that change which tokens an expert computes: megazoo drops the
    tokens over an expert's capacity by position (Megatron's "position" policy), pads nothing and
    adds no jitter."""
    capacity = getattr(args, "moe_expert_capacity_factor", None)
    policy = getattr(args, "moe_token_drop_policy", None) or "probs"  # megatron-core's default
    if capacity is not None and policy != "position":
        _refuse(where, "moe_token_drop_policy", policy,
                "megazoo drops the tokens over capacity by position (Megatron's 'position' "
                "policy), not by routing probability")
    for arg, bad, why in (
            ("moe_pad_expert_input_to_capacity", bool, "expert inputs padded to capacity"),
            ("moe_input_jitter_eps", bool, "jitter on the router's input"),
            ("moe_apply_probs_on_input", bool, "routing weights applied to the expert's input")):
        value = getattr(args, arg, None)
        if value is not None and bad(value):
            _refuse(where, arg, value, why)


def args_fields(config) -> dict:
    """Megatron-LM's MoE args of a megazoo config (the inverse of `config_fields`)."""
    pattern = [int(config.is_moe_layer(i)) for i in range(config.num_layers)]
    return dict(
        num_experts=config.num_experts, moe_router_topk=config.moe_router_topk,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_router_pre_softmax=config.moe_router_pre_softmax and not config.moe_norm_topk_prob,
        moe_router_score_function=config.moe_router_score_function,
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=config.moe_router_bias_update_rate,
        moe_router_num_groups=config.moe_router_num_groups,
        moe_router_group_topk=config.moe_router_group_topk,
        moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type=config.moe_router_load_balancing_type,
        moe_aux_loss_coeff=config.moe_aux_loss_coeff, moe_z_loss_coeff=config.moe_z_loss_coeff,
        moe_expert_capacity_factor=config.moe_expert_capacity_factor,
        moe_token_drop_policy="position",
        moe_layer_freq=config.moe_layer_freq if not config.moe_first_dense_layers else pattern,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate,
        moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False)


def unexportable(config) -> str | None:
    """What of this MoE model's routing Megatron-core cannot hold (None: it holds all of it)."""
    sigmoid = config.moe_router_score_function == "sigmoid"
    if sigmoid and config.moe_norm_topk_prob != (config.moe_router_topk > 1):
        return "sigmoid top-k weights normalised otherwise than for moe_router_topk > 1"
    if config.moe_router_num_groups and config.moe_router_topk // config.moe_router_group_topk != 2:
        return "groups scored by other than moe_router_topk // moe_router_group_topk = 2 experts"
    return None


def stage_offsets(args, num_layers: int, pp: int, vpp: int, where: str) -> dict[tuple[int, int], int]:
    """(pipeline rank, virtual stage) -> its first global layer, as megatron-core's
    `get_transformer_layer_offset` places them, uneven first / last stages included
    (`decoder_first_pipeline_num_layers`, `decoder_last_pipeline_num_layers`)."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if first is None and last is None:
        per = num_layers // (pp * vpp)
        return {(p, v): (v * pp + p) * per for p in range(pp) for v in range(vpp)}
    if vpp > 1:
        _refuse(where, "decoder_first_pipeline_num_layers", first, "uneven stages with virtual "
                "pipeline stages are not read")
    for arg in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(args, arg, False):
            _refuse(where, arg, True, "a pipeline split counting the embedding or the loss")
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    per = middle // middle_stages if middle_stages > 0 else 0
    if middle < 0 or (middle_stages > 0 and middle % middle_stages) or \
            (middle_stages == 0 and middle):
        _refuse(where, "decoder_first_pipeline_num_layers", first, f"with "
                f"decoder_last_pipeline_num_layers={last}, {num_layers} layers do not split over "
                f"pp={pp}")
    return {(p, 0): 0 if p == 0 else (p - (first is not None)) * per + (first or 0)
            for p in range(pp)}


def expand_grouped(key: str, tensor: torch.Tensor, local_experts: int, hidden: int):
    """[(key, tensor)] of one stage file's entry: a legacy GroupedMLP weight as SequentialMLP's
    per-expert tensors (`local_experts.{e}.linear_fc{1,2}.weight`, this rank's [gate_r; up_r]
    rows as Megatron splits them), any other entry as it is. The GroupedMLP views weight1 as
    [local experts, h, fc1 / tp] and weight2 as [local experts, ffn / tp, h]."""
    m = _GROUPED.fullmatch(key)
    if m is None:
        return [(key, tensor)]
    if m[2] == "1":
        per = tensor.reshape(local_experts, hidden, -1).transpose(1, 2)
    else:
        per = tensor.reshape(local_experts, -1, hidden).transpose(1, 2)
    return [(f"{m[1]}local_experts.{e}.linear_fc{m[2]}.weight", per[e].contiguous())
            for e in range(local_experts)]
