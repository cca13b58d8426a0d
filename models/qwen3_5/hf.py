"""Qwen3.5 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text) to and from transformers: every
config.json field mapped, neutral (models/hf_fields.py) or refused in one line; the tensors keep
transformers' names (models/qwen3_5/model.py builds the same module tree), so import and export
are the identity on the state dict and an export is bit-identical to what was imported.

Released checkpoints are the vision-language model (`Qwen3_5ForConditionalGeneration`): config.json
has model_type `qwen3_5` with the text model's fields in `text_config`, and the tensors are named
`model.language_model.*` beside `model.visual.*` (the vision tower) and `mtp.*` (the
multi-token-prediction head). The import reads the text config, renames `model.language_model.`
to `model.` and leaves the vision and MTP tensors out with one logged line, as transformers'
`Qwen3_5ForCausalLM` does (its conversion mapping for qwen3_5_text; its keys ignored on load).
A `qwen3_5_moe` release (Qwen3.5's MoE sizes) is another family's: models/qwen3_5_moe_text reads
it with `text_config_of(release, "qwen3_5_moe")` and `release_text_tensors`.
"""
from __future__ import annotations

import logging

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
# transformers' text model reads no encoder-decoder setting; the released text_config's
# full_attention_interval is folded into layer_types (mapped), its MTP sizes describe the `mtp.*`
# tensors left out (as transformers leaves them), mamba_ssm_dtype is the inference cache's dtype
IGNORED = frozenset({"is_encoder_decoder", "full_attention_interval", "mtp_num_hidden_layers",
                     "mtp_use_dedicated_embeddings", "mamba_ssm_dtype"})
# Qwen's own code's switches that transformers' Qwen3.5 has fixed: gated attention, every MLP dense
FIXED = {"attn_output_gate": True, "mlp_only_layers": []}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
RELEASE_PREFIX = "model.language_model."  # the text model inside the released VL checkpoint
NOT_MODELLED = ("model.visual.", "mtp.")  # its vision tower and multi-token-prediction head

logger = logging.getLogger(__name__)


def config_from_hf(hf) -> Qwen35Config:
    """A Qwen35Config from a `transformers.Qwen3_5TextConfig` (every field checked), or from a
    release's `Qwen3_5Config` (its `text_config`; the vision part left out, logged)."""
    if hasattr(hf, "text_config"):
        hf = text_config_of(hf)
    check_fields(hf, FAMILY, MAPPED, IGNORED, FIXED)
    return base_config(hf, FAMILY)


def text_config_of(release, model_type: str = "qwen3_5", family: str = FAMILY):
    """The text config inside a released vision-language config of `model_type`, refusing
    another model_type (qwen3_5_moe is the qwen3_5_moe_text family's) or a top-level
    tie_word_embeddings that contradicts it."""
    kind = getattr(release, "model_type", None)
    if kind != model_type:
        raise refuse(family, "model_type", kind, f"{model_type!r} (a qwen3_5 / qwen3_5_moe release "
                     f"is read by the qwen3_5_text / qwen3_5_moe_text family)")
    text = release.text_config
    top = getattr(release, "tie_word_embeddings", text.tie_word_embeddings)
    if bool(top) != bool(text.tie_word_embeddings):
        raise refuse(family, "tie_word_embeddings", top,
                     f"text_config's value ({text.tie_word_embeddings})")
    logger.info("%s: reading the text model of a %s release; its vision config is not modelled "
                "and is left out", family, model_type)
    return text


def base_config(hf, family: str, intermediate_size: int | None = None) -> Qwen35Config:
    """The fields Qwen3.5 shares with Qwen3-Next and Qwen3.5-MoE, checked (`family` names it in
    errors); `intermediate_size` for a config without a dense MLP (Qwen3.5-MoE's has none)."""
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
        intermediate_size=hf.intermediate_size if intermediate_size is None else intermediate_size,
        layer_types=tuple(hf.layer_types),
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
    """transformers' tensors -> this model's (same names; the tied head's copy dropped), from the
    text model's layout or a release's (`release_text_tensors`)."""
    out = release_text_tensors(state, FAMILY)
    if c.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def release_text_tensors(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The text model's tensors under transformers' text-model names: a release's
    `model.language_model.*` renamed `model.*`, its vision and MTP tensors left out (one logged
    line naming how many); a state dict already in the text layout passes unchanged."""
    skipped = [k for k in state if k.startswith(NOT_MODELLED)]
    if skipped:
        logger.info("%s: leaving out %d tensors megazoo does not model (vision tower model.visual.*, "
                    "multi-token prediction mtp.*), e.g. %s", family, len(skipped), skipped[0])
    return {("model." + k[len(RELEASE_PREFIX):]) if k.startswith(RELEASE_PREFIX) else k: v
            for k, v in state.items() if not k.startswith(NOT_MODELLED)}


def to_hf_state_dict(state: dict[str, torch.Tensor], c: Qwen35Config) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
