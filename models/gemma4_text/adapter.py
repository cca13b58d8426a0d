"""Gemma 4 text <-> Hugging Face `Gemma4ForCausalLM` (`Gemma4TextConfig`): every config field
mapped both ways or refused, and the tensors (Gemma 3's layout, models/gemma_like.py,
plus each layer's `layer_scalar`). Full layers may have their own head size (global_head_dim -> global_kv_channels).
Not modelled, each refused in one line naming the field: full layers with their own key/value
heads, per-layer input embeddings, KV sharing,
attention_k_eq_v, the MoE block beside the MLP, bidirectional attention, attention bias."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from .. import gemma_like

FAMILY = "Gemma4"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "attention_dropout", "sliding_window", "layer_types",
    "final_logit_softcapping", "use_bidirectional_attention", "hidden_size_per_layer_input",
    "attention_k_eq_v", "num_global_key_value_heads", "num_kv_shared_layers", "enable_moe_block", "per_layer_config"})
# read by transformers only with a feature refused above: per-layer inputs' vocabulary, the
# KV-sharing layers' wide MLP, the MoE block's shape
IGNORED = frozenset({"vocab_size_per_layer_input", "use_double_wide_mlp", "num_experts",
                     "top_k_experts", "moe_intermediate_size"})
_OFF = (("hidden_size_per_layer_input", (0, None), "0 (no per-layer input embeddings)"),
        ("num_kv_shared_layers", (0, None), "0 (every layer its own keys and values)"),
        ("enable_moe_block", (False, None), "False (a dense MLP only)"),
        # "vision" (the releases' value) opens the mask among image tokens only: text is causal
        ("use_bidirectional_attention", (False, None, "vision"),
         "None or 'vision' (causal attention over text)"),
        ("attention_bias", (False,), "False"))


def _full_layers(hf, full: tuple[int, ...]) -> tuple[int | None, int | None]:
    """(the full layers' own head size (global_head_dim), their own key/value heads
    (num_global_key_value_heads, which transformers applies with attention_k_eq_v only)), each
    None where it equals the sliding layers'; full layers of two sizes refused."""
    fields = hf.to_dict()  # (transformers refuses hf.head_dim itself when layers differ)
    head_dim, kv_heads = fields["head_dim"], fields["num_key_value_heads"]
    out = []
    for name, default in (("head_dim", head_dim), ("num_key_value_heads", kv_heads)):
        sizes = {getattr(hf.per_layer_config[i], name) for i in full}
        if len(sizes) > 1:
            raise refuse(FAMILY, "per_layer_config", sorted(sizes),
                         f"one {name} for the full layers")
        size = sizes.pop() if sizes else default
        out.append(size if size != default else None)
    return out[0], out[1]


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Gemma4TextConfig` (every field checked)."""
    for field, want, say in _OFF:
        if getattr(hf, field, None) not in want:
            raise refuse(FAMILY, field, getattr(hf, field), say)
    check_fields(hf, FAMILY, MAPPED, IGNORED)
    if hf.hidden_activation not in gemma_like.TANH_GELU:
        raise refuse(FAMILY, "hidden_activation", hf.hidden_activation, list(gemma_like.TANH_GELU))
    full, window = gemma_like.layers_from_hf(hf, FAMILY)
    global_head_dim, global_kv_heads = _full_layers(hf, full)
    theta, scaling, local_theta = gemma_like.rope_from_hf(hf, FAMILY, partial=("proportional",))
    fields = hf.to_dict()
    return TransformerConfig(
        family="gemma4_text", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_query_groups=fields["num_key_value_heads"], kv_channels=fields["head_dim"],
        global_kv_channels=global_head_dim, global_num_query_groups=global_kv_heads,
        attention_k_eq_v=bool(hf.attention_k_eq_v) and bool(full),
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta, sliding_window=window,
        full_attention_layers=full if window is not None else (),
        normalization="rmsnorm", layernorm_epsilon=hf.rms_norm_eps,
        activation="geglu_tanh", qk_layernorm=True, post_norms=True, embedding_scale=True,
        value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0,
        final_logit_softcapping=hf.final_logit_softcapping,
        bias=False, tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Gemma4TextConfig` of a megazoo Gemma 4 text config (for export)."""
    from transformers import Gemma4TextConfig
    kv_heads = config.global_num_query_groups
    if kv_heads not in (None, config.num_query_groups) and not config.attention_k_eq_v:
        raise ValueError(f"Gemma4 export: global_num_query_groups={kv_heads} without "
                         f"attention_k_eq_v cannot be written (transformers applies "
                         f"num_global_key_value_heads with attention_k_eq_v only); drop it")
    return Gemma4TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        global_head_dim=config.global_kv_channels or config.head_dim, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False, attention_dropout=config.attention_dropout,
        sliding_window=config.sliding_window or 512,
        final_logit_softcapping=config.final_logit_softcapping,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=config.attention_k_eq_v,
        num_global_key_value_heads=kv_heads, enable_moe_block=False,
        **gemma_like.hf_layer_fields(config),
        **{"architectures": ["Gemma4ForCausalLM"], **extra})


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF Gemma4ForCausalLM tensors -> full megazoo tensors (models/gemma_like.py)."""
    return gemma_like.from_hf_state_dict(sd, config)


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF Gemma4ForCausalLM tensors (no lm_head when tied)."""
    return gemma_like.to_hf_state_dict(full, config)
