"""Gemma 3 text <-> Hugging Face `Gemma3ForCausalLM` (`Gemma3TextConfig`): every config field
mapped both ways or refused, and the tensors (q, k, v fused per key/value group and [gate; up]
fused as models/llama_like.py does; Gemma's four norms per layer named here)."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from .. import gemma_like

FAMILY = "Gemma3"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "attention_dropout", "query_pre_attn_scalar", "sliding_window",
    "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention"})
# older released files give the layer pattern as sliding_window_pattern; transformers turns it
# into layer_types (mapped) and reads it no further
IGNORED = frozenset({"sliding_window_pattern"})


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Gemma3TextConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, IGNORED)
    for field, value, want in (("hidden_activation", hf.hidden_activation, gemma_like.TANH_GELU),
                               ("attention_bias", hf.attention_bias, (False,)),
                               ("use_bidirectional_attention",
                                hf.use_bidirectional_attention, (False, None))):
        if value not in want:
            raise refuse(FAMILY, field, value, list(want))
    if hf.attn_logit_softcapping is not None:
        # transformers' Gemma3Attention stores it but never passes it to its attention: a
        # config that sets it names two different models (megazoo's spec could compute it)
        raise refuse(FAMILY, "attn_logit_softcapping", hf.attn_logit_softcapping,
                     "None (transformers' Gemma 3 attention does not apply it)")
    full, window = gemma_like.layers_from_hf(hf, FAMILY)
    theta, scaling, local_theta = gemma_like.rope_from_hf(hf, FAMILY)
    d = hf.head_dim
    return TransformerConfig(
        family="gemma3_text", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, kv_channels=d,
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta, sliding_window=window,
        full_attention_layers=full if window is not None else (),
        normalization="rmsnorm_offset", layernorm_epsilon=hf.rms_norm_eps,
        activation="geglu_tanh", qk_layernorm=True, post_norms=True, embedding_scale=True,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        final_logit_softcapping=hf.final_logit_softcapping,
        bias=False, tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Gemma3TextConfig` of a megazoo Gemma 3 text config (for export)."""
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False, attention_dropout=config.attention_dropout,
        query_pre_attn_scalar=_integral(config.query_pre_attn_scalar or config.head_dim),
        sliding_window=config.sliding_window or 4096,
        final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=None,
        **gemma_like.hf_layer_fields(config),
        **{"architectures": ["Gemma3ForCausalLM"], **extra})


def _integral(x: float):
    """transformers types query_pre_attn_scalar as an int: a whole number written as one."""
    return int(x) if float(x).is_integer() else x


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF Gemma3ForCausalLM tensors -> full megazoo tensors (models/gemma_like.py)."""
    return gemma_like.from_hf_state_dict(sd, config)


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF Gemma3ForCausalLM tensors (no lm_head when tied)."""
    return gemma_like.to_hf_state_dict(full, config)
