"""The Hugging Face conversion the Llama-shaped families share (Llama, Qwen2, Qwen3, Mistral,
Mixtral, Qwen-MoE, gpt-oss, Gemma 3 reuse parts of it; each family's adapter.py adds its own
fields): the config fields of transformers' `LlamaConfig` and its descendants, RoPE and
sliding-window fields, and the `LlamaForCausalLM` tensor names.

HF keeps q, k, v and gate, up as separate projections; megazoo fuses them: QKV per key/value
group as [that group's query heads, key, value] (see models/attention.py), and fc1 as [gate; up].
HF rotates [first half | second half] of each head (`rotate_half`), as models/rope.py does, so
no permutation of q/k rows is needed.
"""
from __future__ import annotations

import logging

import torch


from .config import ROPE_TYPES, TransformerConfig, canonical_rope_scaling
from .hf_fields import refuse
from .language_model import WORD_EMBEDDINGS
from .rope import rope_type

logger = logging.getLogger(__name__)


MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
    "attention_dropout", "attention_bias", "mlp_bias", "head_dim"})
# transformers' LlamaForCausalLM ignores these (pretraining_tp only split the same matmuls in
# older versions; max_sequence_length is LLaMA-1 conversions' copy of max_position_embeddings;
# the others are SmolLM2's notes)
IGNORED = frozenset({"pretraining_tp", "is_llama_config", "rope_interleaved", "max_sequence_length"})


# the window fields of Qwen2/3-shaped configs (transformers derives layer_types from the others)
WINDOW_MAPPED = frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                           "layer_types"})


# hidden_act values transformers computes as SiLU (ACT2FN maps both to nn.SiLU)
SILU_NAMES = ("silu", "swish")


def rope_from_hf(hf, family: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from the old `rope_theta`/`rope_scaling` attributes or
    the newer `rope_parameters` dict (models/rope.py computes every type of config.ROPE_TYPES)."""
    params = dict(canonical_rope_scaling(getattr(hf, "rope_parameters", None)
                                         or getattr(hf, "rope_scaling", None)) or {})
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    partial = params.pop("partial_rotary_factor", 1.0)
    kind = rope_type(params)
    if kind not in ROPE_TYPES:
        raise refuse(family, "rope_parameters.rope_type", kind, list(ROPE_TYPES))
    if partial != 1.0:
        # These families' default RoPE reads only rope_theta and rotates the whole head (the
        # other types' frequencies would not fit the head: transformers fails on them).
        if kind != "default":
            raise refuse(family, "partial_rotary_factor", partial,
                         f"1.0 with rope_type {kind!r} (transformers cannot run it either)")
        logger.info("%s config.json: partial_rotary_factor %s is ignored by transformers' %s "
                    "with default RoPE (the whole head rotates); megazoo computes the same and "
                    "writes it back at export", family, partial, family)
        return float(theta), {"rope_type": "default", "partial_rotary_factor": partial}
    return float(theta), (params if kind != "default" else None)


def window_from_hf(hf, family: str, layer_types: list[str] | None) -> dict:
    """sliding_window and full_attention_layers from HF's window fields. `layer_types` (Qwen2/3:
    derived by transformers from use_sliding_window and max_window_layers, or given) names each
    layer's attention; None (Mistral, Mixtral): `sliding_window` applies to every layer."""
    window = getattr(hf, "sliding_window", None)
    if layer_types is None:
        return dict(sliding_window=window)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != hf.num_hidden_layers:
        raise refuse(family, "layer_types", layer_types, f"{hf.num_hidden_layers} entries of "
                     f"'full_attention' or 'sliding_attention'")
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    if window is None or len(full) == len(layer_types):
        if len(full) != len(layer_types):
            raise refuse(family, "layer_types", layer_types,
                         "'sliding_attention' layers only with use_sliding_window and a sliding_window")
        return dict(sliding_window=None)
    return dict(sliding_window=int(window), full_attention_layers=full)


def window_hf_fields(config: TransformerConfig) -> dict:
    """Qwen2/3's window fields for `config` (every layer's type written out)."""
    types = ["full_attention" if config.attention_window(i) is None else "sliding_attention"
             for i in range(config.num_layers)]
    fields = dict(use_sliding_window=config.sliding_window is not None,
                  sliding_window=config.sliding_window, layer_types=types)
    full = config.full_attention_layers
    if config.sliding_window is not None and full == tuple(range(len(full))):
        fields["max_window_layers"] = len(full)  # the form transformers derives layer_types from
    return fields


def check_full_attention(hf, family: str) -> None:
    """For the families without sliding windows (Qwen2-MoE): every layer attends to the whole
    context (transformers derives `layer_types` from use_sliding_window and max_window_layers)."""
    if window_from_hf(hf, family, hf.layer_types)["sliding_window"] is not None:
        raise refuse(family, "layer_types", hf.layer_types, "'full_attention' in every layer "
                     "(use_sliding_window=False)")


def llama_like_config(hf, label: str, **fields) -> TransformerConfig:
    """The TransformerConfig shared by Llama, Qwen2 and Qwen3 (`label` names the HF family in
    errors; `fields` add or override, the registry's `family` among them)."""
    if hf.hidden_act not in SILU_NAMES:
        raise refuse(label, "hidden_act", hf.hidden_act, list(SILU_NAMES))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    theta, scaling = rope_from_hf(hf, label)
    return TransformerConfig(**{**dict(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
        kv_channels=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
        normalization="rmsnorm", layernorm_epsilon=hf.rms_norm_eps, activation="swiglu",
        bias=False, tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range), **fields})


def llama_like_hf_fields(config: TransformerConfig, family: str, *, add_qkv_bias: bool,
                         qk_layernorm: bool) -> dict:
    """The HF config fields shared by Llama, Qwen2 and Qwen3; refuses what the family lacks."""
    if (config.add_qkv_bias, config.qk_layernorm) != (add_qkv_bias, qk_layernorm) or \
            not (config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx):
        raise ValueError(f"this model (add_qkv_bias={config.add_qkv_bias}, qk_layernorm="
                         f"{config.qk_layernorm}, attention scaling) cannot be exported as {family}")
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_epsilon, hidden_act="silu",
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope,
        attention_dropout=config.attention_dropout, initializer_range=config.init_method_std)


def fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    """HF q [heads*d, ...], k, v [groups*d, ...] -> per group [q heads of the group, k, v]."""
    per = lambda t: t.reshape(groups, -1, *t.shape[1:])  # noqa: E731
    fused = torch.cat([per(q), per(k), per(v)], dim=1)
    return fused.reshape(-1, *q.shape[1:])


def split_qkv(t, config: TransformerConfig):
    groups, d = config.num_query_groups, config.head_dim
    q_rows = config.num_attention_heads // groups * d
    q, k, v = t.reshape(groups, -1, *t.shape[1:]).split([q_rows, d, d], dim=1)
    return [x.reshape(-1, *t.shape[1:]) for x in (q, k, v)]


def _kinds(config: TransformerConfig, qkv: bool = False):
    with_bias = config.bias or (qkv and config.add_qkv_bias)
    return ("weight", "bias") if with_bias else ("weight",)


def _pairs(config: TransformerConfig):
    """(megazoo name, HF name) of the tensors mapped one to one."""
    yield WORD_EMBEDDINGS, "model.embed_tokens.weight"
    yield "final_norm.weight", "model.norm.weight"
    if not config.tie_word_embeddings:  # HF does not save a tied lm_head
        yield "head_weight", "lm_head.weight"
    for i in range(config.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        yield m + "input_norm.weight", h + "input_layernorm.weight"
        yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"
        for kind in _kinds(config):
            yield m + f"attention.dense.{kind}", h + f"self_attn.o_proj.{kind}"
            if not config.is_moe_layer(i):  # MoE layers: the MoE families' adapters
                yield m + f"mlp.fc2.{kind}", h + f"mlp.down_proj.{kind}"
        if config.qk_layernorm:  # Qwen3
            yield m + "attention.q_norm.weight", h + "self_attn.q_norm.weight"
            yield m + "attention.k_norm.weight", h + "self_attn.k_norm.weight"


def _fused(config: TransformerConfig, qkv: bool):
    """(layer's megazoo prefix, layer's HF prefix, kind) of the fused qkv tensors, or of the
    dense layers' fused fc1 (MoE layers' experts: the MoE families' adapters)."""
    for i in range(config.num_layers):
        if not qkv and config.is_moe_layer(i):
            continue
        for kind in _kinds(config, qkv):
            yield f"layers.{i}.", f"model.layers.{i}.", kind


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM tensors -> full megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = {mz: sd[hf] for mz, hf in _pairs(config)}
    for m, h, kind in _fused(config, qkv=True):
        q, k, v = (sd[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        out[m + f"attention.qkv.{kind}"] = fuse_qkv(q, k, v, config.num_query_groups)
    for m, h, kind in _fused(config, qkv=False):
        gate, up = sd[h + f"mlp.gate_proj.{kind}"], sd[h + f"mlp.up_proj.{kind}"]
        out[m + f"mlp.fc1.{kind}"] = torch.cat([gate, up])
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF LlamaForCausalLM tensors (no lm_head when tied, as HF saves)."""
    out = {hf: full[mz] for mz, hf in _pairs(config)}
    for m, h, kind in _fused(config, qkv=True):
        for x, t in zip("qkv", split_qkv(full[m + f"attention.qkv.{kind}"], config)):
            out[h + f"self_attn.{x}_proj.{kind}"] = t
    for m, h, kind in _fused(config, qkv=False):
        gate, up = full[m + f"mlp.fc1.{kind}"].chunk(2)
        out[h + f"mlp.gate_proj.{kind}"], out[h + f"mlp.up_proj.{kind}"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}
