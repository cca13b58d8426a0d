"""DeepSeek-V3's Hugging Face adapter (Kimi K2's layout too): `DeepseekV3Config` and the
`DeepseekV3ForCausalLM` tensors, both ways. Multi-head latent attention (models/mla.py), the first
`first_k_dense_replace` layers dense SwiGLU MLPs, the rest DeepSeek MoE layers (sigmoid routing
with the expert bias, group-limited, renormalised, scaled; `n_shared_experts` shared experts as
one ungated shared MLP of their summed width; models/moe.py).

HF routes with groups always; `n_group` 1 is plain top-k (no group limit in megazoo). HF keeps
the expert bias as the buffer `e_score_correction_bias`; megazoo as the frozen `expert_bias`,
updated in training (`--moe-router-bias-update-rate`). HF's config records no aux-loss
coefficient: imported models train without one unless the flags add it. The multi-token
prediction depths (`num_nextn_predict_layers`, models/multi_token_prediction.py) are the released
files' `model.layers.{num_hidden_layers + k}.*` (transformers skips them; megazoo trains them):
their copies of the embedding and head must equal the main ones on import and are written back
on export. RoPE scaling (the released configs' YaRN, with its `mscale_all_dim` softmax
correction) is modelled by models/mla.py. Not modelled, refused: the length-dependent scalings
(dynamic, longrope), attention biases, `rms_norm_eps` other than the latent norms' fixed 1e-6.
"""
from __future__ import annotations

import logging

import torch

from .. import llama_like
from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..language_model import WORD_EMBEDDINGS
from ..qwen_moe_like import stacked_experts
from ..rope import rope_type

logger = logging.getLogger(__name__)

FAMILY = "DeepSeek-V3"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
    "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_interleave", "attention_dropout",
    "num_nextn_predict_layers",
    # derived by transformers from the fields above
    "qk_head_dim", "head_dim"})
# output_router_logits only adds outputs; pretraining_tp is not used by the modelling code;
# ep_size (the released files' expert-parallel degree for DeepSeek's own inference code) changes
# no number; aux_loss_alpha and seq_aux (Kimi K2's files) are training settings of that code,
# which transformers does not read either: megazoo's aux loss is its --moe-aux-loss-coeff
IGNORED = frozenset({"output_router_logits", "pretraining_tp", "ep_size", "aux_loss_alpha",
                     "seq_aux"})
# the released files' routing settings for DeepSeek's own modelling code: transformers always
# routes by sigmoid scores with the bias-corrected group top-k, every layer after the first
# first_k_dense_replace sparse
FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm take the default eps
# RoPE scalings multi-latent attention models (models/mla.py: not the length-dependent ones);
# a partial_rotary_factor record (rope_type default) has no meaning for MLA's rope channels
SCALINGS = ("yarn", "linear", "llama3")


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.DeepseekV3Config` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, IGNORED, FIXED)
    theta, scaling = llama_like.rope_from_hf(hf, FAMILY)
    if scaling is not None and rope_type(scaling) not in SCALINGS:
        raise refuse(FAMILY, "rope_parameters.rope_type", rope_type(scaling),
                     f"'default' or one of {list(SCALINGS)} (no partial_rotary_factor)")
    checks = (("hidden_act", hf.hidden_act, "silu", "'silu'"),
              ("rms_norm_eps", hf.rms_norm_eps, LATENT_NORM_EPS, LATENT_NORM_EPS),
              ("num_key_value_heads", hf.num_key_value_heads, hf.num_attention_heads,
               "num_attention_heads (MLA has no key/value groups)"))
    for field, value, want, supported in checks:
        if value != want:
            raise refuse(FAMILY, field, value, supported)
    if not hf.n_shared_experts or hf.n_shared_experts < 1:
        raise refuse(FAMILY, "n_shared_experts", hf.n_shared_experts, ">= 1")
    grouped = hf.n_group and hf.n_group > 1
    return TransformerConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, position_embedding="rope",
        rope_theta=theta, rope_scaling=scaling, normalization="rmsnorm",
        layernorm_epsilon=hf.rms_norm_eps,
        activation="swiglu", bias=False, tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range,
        kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim, rope_interleave=bool(hf.rope_interleave),
        num_experts=hf.n_routed_experts, moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=hf.n_group if grouped else None,
        moe_router_group_topk=hf.topk_group if grouped else None,
        moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
        moe_norm_topk_prob=bool(hf.norm_topk_prob), moe_first_dense_layers=hf.first_k_dense_replace,
        mtp_num_layers=hf.num_nextn_predict_layers or 0)


def _rope_parameters(config: TransformerConfig) -> dict:
    """HF's rope_parameters: rope_theta and the scaling's fields as they were imported."""
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)
    return rope


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.DeepseekV3Config` of a megazoo DeepSeek-V3 configuration (for export)."""
    from transformers import DeepseekV3Config
    problems = [what for what, bad in (
        ("no multi-latent attention", not config.kv_lora_rank),
        ("no experts", not config.num_experts),
        ("softmax routing", config.moe_router_score_function != "sigmoid"),
        ("no expert bias", not config.moe_router_enable_expert_bias),
        ("--moe-layer-freq > 1", config.moe_layer_freq != 1),
        ("a gated shared expert", config.moe_shared_expert_gate),
        ("a shared expert width not a multiple of --moe-ffn-hidden-size",
         (config.moe_shared_expert_intermediate_size or 0) % config.moe_ffn_hidden_size
         or not config.moe_shared_expert_intermediate_size),
        (f"layernorm_epsilon other than {LATENT_NORM_EPS}", config.layernorm_epsilon != LATENT_NORM_EPS),
        ("rope_scaling type " + rope_type(config.rope_scaling),
         config.rope_scaling is not None and rope_type(config.rope_scaling) not in SCALINGS))
        if bad]
    if problems:
        raise ValueError(f"HF {FAMILY} cannot express {', '.join(problems)}; export another family")
    for flag, value in (("--moe-aux-loss-coeff", config.moe_aux_loss_coeff),
                        ("--moe-z-loss-coeff", config.moe_z_loss_coeff),
                        ("--moe-expert-capacity-factor", config.moe_expert_capacity_factor)):
        if value:
            logger.info("%s %s is a training setting HF %s does not record", flag, value, FAMILY)
    groups = config.moe_router_num_groups or 1
    return DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        n_shared_experts=config.moe_shared_expert_intermediate_size // config.moe_ffn_hidden_size,
        n_routed_experts=config.num_experts,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        qk_nope_head_dim=config.qk_nope_head_dim, n_group=groups,
        topk_group=config.moe_router_group_topk or 1, num_experts_per_tok=config.moe_router_topk,
        first_k_dense_replace=config.moe_first_dense_layers, norm_topk_prob=config.moe_norm_topk_prob,
        hidden_act="silu", max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=_rope_parameters(config),
        rope_interleave=config.rope_interleave, attention_bias=False,
        attention_dropout=config.attention_dropout,
        num_nextn_predict_layers=config.mtp_num_layers,
        **{"architectures": ["DeepseekV3ForCausalLM"], **extra})


# megazoo attention name -> HF self_attn name (o_proj / dense: llama's pairs)
_ATTENTION = {"kv_down": "kv_a_proj_with_mqa.weight", "kv_norm.weight": "kv_a_layernorm.weight",
              "kv_up.weight": "kv_b_proj.weight"}
_Q_LATENT = {"q_down": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
             "q_up.weight": "q_b_proj.weight"}
_Q_FULL = {"q_proj.weight": "q_proj.weight"}


def _layers(config: TransformerConfig):
    """(megazoo prefix, HF prefix, global layer number) of every transformer layer: the main
    ones, then each multi-token prediction depth's (HF numbers them on after the main ones)."""
    for i in range(config.num_layers):
        yield f"layers.{i}.", f"model.layers.{i}.", i
    for d in range(config.mtp_num_layers):
        i = config.num_layers + d
        yield f"mtp.depths.{d}.layer.", f"model.layers.{i}.", i


def _mtp_pairs(config: TransformerConfig):
    """(megazoo name, HF name) of the depths' own tensors beside their layers."""
    for d in range(config.mtp_num_layers):
        m, h = f"mtp.depths.{d}.", f"model.layers.{config.num_layers + d}."
        for mz, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_norm", "shared_head.norm")):
            yield m + mz + ".weight", h + hf + ".weight"
        yield m + "eh_proj.weight", h + "eh_proj.weight"


def _shared_copies(config: TransformerConfig):
    """(HF name of a depth's copy, the megazoo tensor it copies): megazoo shares the embedding
    and the head with the main model, as DeepSeek-V3 and Megatron-core do."""
    head = WORD_EMBEDDINGS if config.tie_word_embeddings else "head_weight"
    for d in range(config.mtp_num_layers):
        h = f"model.layers.{config.num_layers + d}."
        yield h + "embed_tokens.weight", WORD_EMBEDDINGS
        yield h + "shared_head.head.weight", head


def _pairs(config: TransformerConfig):
    """(megazoo name, HF name) of the tensors mapped one to one (experts stacked apart)."""
    yield WORD_EMBEDDINGS, "model.embed_tokens.weight"
    yield "final_norm.weight", "model.norm.weight"
    if not config.tie_word_embeddings:  # HF does not save a tied lm_head
        yield "head_weight", "lm_head.weight"
    attention = {**_ATTENTION, **(_Q_LATENT if config.q_lora_rank else _Q_FULL)}
    for m, h, i in _layers(config):
        yield m + "input_norm.weight", h + "input_layernorm.weight"
        yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"
        yield m + "attention.dense.weight", h + "self_attn.o_proj.weight"
        for mz, hf in attention.items():
            yield m + "attention." + mz, h + "self_attn." + hf
        if config.is_moe_layer(i):
            yield m + "mlp.router", h + "mlp.gate.weight"
            yield m + "mlp.expert_bias", h + "mlp.gate.e_score_correction_bias"
            yield m + "mlp.shared_expert.fc2.weight", h + "mlp.shared_experts.down_proj.weight"
        else:
            yield m + "mlp.fc2.weight", h + "mlp.down_proj.weight"
    yield from _mtp_pairs(config)


MTP_FIELD = "num_nextn_predict_layers"  # the HF field of config.mtp_num_layers


def mtp_weights_present(sd: dict[str, torch.Tensor], config: TransformerConfig) -> bool:
    """Whether HF tensors hold the prediction depths config.json names: transformers keeps
    num_nextn_predict_layers but neither loads nor saves their weights (the HF import then
    imports the main model without them: training/checkpoint/hf.py)."""
    first = f"layers.{config.num_layers}.eh_proj.weight"
    return not config.mtp_num_layers or first in sd or "model." + first in sd


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF DeepseekV3ForCausalLM tensors (file or in-memory form) -> full megazoo tensors. The
    depths' copies of the embedding and head must equal the main ones (megazoo shares them)."""
    if not mtp_weights_present(sd, config):
        raise ValueError(f"{FAMILY}: num_nextn_predict_layers {config.mtp_num_layers} but the "
                         f"weights have no model.layers.{config.num_layers}.eh_proj.weight (a "
                         f"transformers model drops them); map them with mtp_num_layers=0")
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = {mz: sd[hf] for mz, hf in _pairs(config)}
    for copy, mz in _shared_copies(config):
        if copy in sd and not torch.equal(sd[copy], out[mz]):
            raise ValueError(f"{FAMILY}: {copy} differs from the main model's "
                             f"{'model.embed_tokens' if mz == WORD_EMBEDDINGS else 'lm_head'}; "
                             f"megazoo shares the embedding and head with the prediction depths")
    for m, h, i in _layers(config):
        if not config.is_moe_layer(i):  # dense [gate; up]
            out[m + "mlp.fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"],
                                                   sd[h + "mlp.up_proj.weight"]])
            continue
        m, h = m + "mlp.", h + "mlp."
        out[m + "shared_expert.fc1.weight"] = torch.cat([sd[h + "shared_experts.gate_proj.weight"],
                                                         sd[h + "shared_experts.up_proj.weight"]])
        out[m + "experts.weight1"], out[m + "experts.weight2"] = stacked_experts(sd, h, config.num_experts)
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF DeepSeek-V3 tensors in the file form of the released
    checkpoints (experts apart; no lm_head when tied; each prediction depth with its copies of
    the embedding and head, as released)."""
    out = {hf: full[mz] for mz, hf in _pairs(config)}
    out.update({copy: full[mz] for copy, mz in _shared_copies(config)})
    for m, h, i in _layers(config):
        if not config.is_moe_layer(i):
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = \
                full[m + "mlp.fc1.weight"].chunk(2)
            continue
        m, h = m + "mlp.", h + "mlp."
        out[h + "shared_experts.gate_proj.weight"], out[h + "shared_experts.up_proj.weight"] = \
            full[m + "shared_expert.fc1.weight"].chunk(2)
        for e in range(config.num_experts):
            x = h + f"experts.{e}."
            out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = full[m + "experts.weight1"][e].chunk(2)
            out[x + "down_proj.weight"] = full[m + "experts.weight2"][e]
    return {k: v.contiguous() for k, v in out.items()}
