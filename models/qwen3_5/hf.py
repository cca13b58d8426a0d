"""Qwen3.5 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text) to and from transformers: every
config.json field mapped, neutral (models/hf_fields.py) or refused in one line; the tensors keep
transformers' names (models/qwen3_5/model.py builds the same module tree), so import and export
are the identity on the state dict and an export is bit-identical to what was imported.
"""
from __future__ import annotations

import torch

from ..hf_fields import check_fields, refuse
from .model import LAYER_TYPES, Qwen35Config

FAMILY = "Qwen3.5"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout",
    "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "layer_types"})
# transformers' text model reads no encoder-decoder setting
IGNORED = frozenset({"is_encoder_decoder"})
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_from_hf(hf) -> Qwen35Config:
    """A Qwen35Config from a `transformers.Qwen3_5TextConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, IGNORED)
    return base_config(hf, FAMILY)


def base_config(hf, family: str) -> Qwen35Config:
    """The fields Qwen3.5 shares with Qwen3-Next, checked (`family` names it in errors)."""
    FAMILY = family  # noqa: N806 - the refusals below name the family read
    if hf.hidden_act not in ("silu", "swish"):
        raise refuse(FAMILY, "hidden_act", hf.hidden_act, "silu")
    if hf.attention_dropout:
        raise refuse(FAMILY, "attention_dropout", hf.attention_dropout, 0.0)
    rope = dict(hf.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise refuse(FAMILY, "rope_parameters.rope_type", rope.get("rope_type"), "default")
    unknown = set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section",
                           "mrope_interleaved"}
    if unknown:
        raise refuse(FAMILY, "rope_parameters", sorted(unknown), "rope_theta, "
                     "partial_rotary_factor, mrope_section, mrope_interleaved")
    bad = sorted(set(hf.layer_types) - set(LAYER_TYPES))
    if bad or len(hf.layer_types) != hf.num_hidden_layers:
        raise refuse(FAMILY, "layer_types", hf.layer_types,
                     f"{hf.num_hidden_layers} entries of {LAYER_TYPES}")
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        raise refuse(FAMILY, "linear_num_value_heads", hf.linear_num_value_heads,
                     f"a multiple of linear_num_key_heads ({hf.linear_num_key_heads})")
    extra = {k: getattr(hf, k) for k in TOKEN_IDS}
    extra["rope_extra"] = {k: v for k, v in rope.items()
                           if k not in ("rope_theta", "partial_rotary_factor")}
    return Qwen35Config(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, layer_types=tuple(hf.layer_types),
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim, linear_num_key_heads=hf.linear_num_key_heads,
        linear_num_value_heads=hf.linear_num_value_heads,
        linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        attention_bias=bool(hf.attention_bias), tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=hf.max_position_embeddings,
        initializer_range=hf.initializer_range, extra=extra)


def hf_config(c: Qwen35Config):
    """The `transformers.Qwen3_5TextConfig` of `c` (export)."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**hf_fields(c))


def hf_fields(c: Qwen35Config) -> dict:
    """The config.json fields Qwen3.5 shares with Qwen3-Next."""
    rope = {"rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor,
            **c.extra.get("rope_extra", {"rope_type": "default"})}
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=len(c.layer_types), num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=rope, attention_bias=c.attention_bias, attention_dropout=0.0,
        head_dim=c.head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads, layer_types=list(c.layer_types),
        architectures=["Qwen3_5ForCausalLM"], **{k: c.extra.get(k) for k in TOKEN_IDS})


def from_hf_state_dict(state: dict[str, torch.Tensor], c: Qwen35Config) -> dict[str, torch.Tensor]:
    """transformers' tensors -> this model's (same names; the tied head's copy dropped; the
    multi-token-prediction and vision tensors of a full release refused)."""
    foreign = sorted(k for k in state if k.startswith(("mtp.", "model.visual.")))
    if foreign:
        raise ValueError(f"{FAMILY}: {foreign[0]} ({len(foreign)} tensors) belongs to the "
                         f"multi-token-prediction or vision part, which megazoo does not model; "
                         f"export the text model (Qwen3_5ForCausalLM) without it")
    out = dict(state)
    if c.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], c: Qwen35Config) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
