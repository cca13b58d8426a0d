"""Llama family (Llama 2/3, SmolLM2, ...): rotary positions, RMSNorm, SwiGLU, grouped-query
attention, untied (or tied) embeddings; and the mapping to and from Hugging Face
`LlamaForCausalLM` tensors.

HF keeps q, k, v and gate, up as separate projections; megazoo fuses them: QKV per key/value
group as [that group's query heads, key, value] (see models/attention.py), and fc1 as [gate; up].
HF rotates [first half | second half] of each head (`rotate_half`), as models/rope.py does, so
no permutation of q/k rows is needed.
"""
from __future__ import annotations

import torch

from parallel.topology import ParallelTopology

from .config import TransformerConfig
from .language_model import WORD_EMBEDDINGS, TransformerLanguageModel
from .rope import rope_type


class LlamaModel(TransformerLanguageModel):
    def __init__(self, config: TransformerConfig, topo: ParallelTopology, **kwargs):
        shape = (config.position_embedding, config.normalization, config.activation)
        if shape != ("rope", "rmsnorm", "swiglu") or config.embedding_layernorm:
            raise ValueError("LlamaModel needs position_embedding='rope', normalization='rmsnorm', "
                             "activation='swiglu' and no embedding layernorm")
        super().__init__(config, topo, **kwargs)


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.LlamaConfig` (old `rope_theta`/`rope_scaling`
    attributes or the newer `rope_parameters` dict)."""
    if hf.hidden_act != "silu":
        raise ValueError(f"Llama activation {hf.hidden_act!r} is not supported (only 'silu')")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {hf.num_attention_heads} heads != hidden_size "
                         f"{hf.hidden_size}: decoupled head sizes are not supported")
    attention_bias, mlp_bias = getattr(hf, "attention_bias", False), getattr(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError("Llama with attention_bias != mlp_bias is not supported")
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Llama with partial_rotary_factor != 1 is not supported")
    scaling = params if rope_type(params) != "default" else None
    return TransformerConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=float(theta), rope_scaling=scaling,
        normalization="rmsnorm", layernorm_epsilon=hf.rms_norm_eps, activation="swiglu",
        bias=bool(attention_bias), tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.LlamaConfig` for a megazoo Llama config (extra keys passed through)."""
    from transformers import LlamaConfig
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rope.pop("type", None)
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        hidden_act="silu", tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope,
        attention_bias=config.bias, mlp_bias=config.bias, attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std, **extra)


def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    """HF q [heads*d, ...], k, v [groups*d, ...] -> per group [q heads of the group, k, v]."""
    per = lambda t: t.reshape(groups, -1, *t.shape[1:])  # noqa: E731
    fused = torch.cat([per(q), per(k), per(v)], dim=1)
    return fused.reshape(-1, *q.shape[1:])


def _split_qkv(t, config: TransformerConfig):
    groups, d = config.num_query_groups, config.head_dim
    q_rows = config.num_attention_heads // groups * d
    q, k, v = t.reshape(groups, -1, *t.shape[1:]).split([q_rows, d, d], dim=1)
    return [x.reshape(-1, *t.shape[1:]) for x in (q, k, v)]


def _kinds(config: TransformerConfig):
    return ("weight", "bias") if config.bias else ("weight",)


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
            if not config.is_moe_layer(i):  # MoE layers: models/mixtral.py
                yield m + f"mlp.fc2.{kind}", h + f"mlp.down_proj.{kind}"


def _fused(config: TransformerConfig):
    """(layer's megazoo prefix, layer's HF prefix, kind, dense MLP?) of the fused qkv and fc1
    tensors."""
    for i in range(config.num_layers):
        for kind in _kinds(config):
            yield f"layers.{i}.", f"model.layers.{i}.", kind, not config.is_moe_layer(i)


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM tensors -> full megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = {mz: sd[hf] for mz, hf in _pairs(config)}
    for m, h, kind, dense in _fused(config):
        q, k, v = (sd[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        out[m + f"attention.qkv.{kind}"] = _fuse_qkv(q, k, v, config.num_query_groups)
        if not dense:
            continue
        gate, up = sd[h + f"mlp.gate_proj.{kind}"], sd[h + f"mlp.up_proj.{kind}"]
        out[m + f"mlp.fc1.{kind}"] = torch.cat([gate, up])
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF LlamaForCausalLM tensors (no lm_head when tied, as HF saves)."""
    out = {hf: full[mz] for mz, hf in _pairs(config)}
    for m, h, kind, dense in _fused(config):
        for x, t in zip("qkv", _split_qkv(full[m + f"attention.qkv.{kind}"], config)):
            out[h + f"self_attn.{x}_proj.{kind}"] = t
        if not dense:
            continue
        gate, up = full[m + f"mlp.fc1.{kind}"].chunk(2)
        out[h + f"mlp.gate_proj.{kind}"], out[h + f"mlp.up_proj.{kind}"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}
