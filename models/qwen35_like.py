"""Qwen3.5-style layers (Gated DeltaNet and gated attention) <-> transformers, shared by the
Qwen3.5 text and Qwen3-Next family folders: configs checked by models/qwen3_5/hf.py become
`TransformerConfig` fields whose layers are "gated_deltanet" and "gated_attention" kinds
(models/spec.py); tensors are renamed and fused as megazoo's layers hold them:

    q_proj [heads x (query | gate), hidden]   -> attention.qkv (grouped per key head) + attention.gate
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a -> attention.in_proj ([q | k | v | z | b | a])
    conv1d.weight, norm.weight                -> attention.conv_weight, attention.norm_weight
    gate_proj, up_proj                         -> mlp.fc1 ([gate; up])
"""
from __future__ import annotations

import logging

import torch

from .config import TransformerConfig
from .hf_fields import refuse
from .language_model import WORD_EMBEDDINGS
from .llama_like import fuse_qkv, split_qkv
from .qwen3_5.model import Qwen35Config

logger = logging.getLogger(__name__)
KINDS = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}


def transformer_fields(c: Qwen35Config, family: str, name: str) -> dict:
    """The TransformerConfig fields of a checked single-device config."""
    if c.attention_bias:
        raise refuse(name, "attention_bias", True, "False (megazoo's gated attention has no biases)")
    if {"mrope_section", "mrope_interleaved"} & set(c.extra.get("rope_extra", {})):
        logger.info("%s: mrope_section / mrope_interleaved are the multimodal position layout; "
                    "text positions make them the plain rotation (not kept)", name)
    return dict(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_layers=len(c.layer_types), num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
        position_embedding="rope", rope_theta=c.rope_theta, normalization="rmsnorm_offset",
        layernorm_epsilon=c.rms_norm_eps, activation="swiglu", qk_layernorm=True, bias=False,
        tie_word_embeddings=c.tie_word_embeddings, init_method_std=c.initializer_range,
        hidden_dropout=0.0, token_mixers=tuple(KINDS[t] for t in c.layer_types),
        rotary_fraction=c.partial_rotary_factor, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel=c.linear_conv_kernel_dim)


def standalone_fields(config: TransformerConfig) -> dict:
    """The single-device config's fields (models/qwen3_5/model.py) of a megazoo config."""
    kinds = {v: k for k, v in KINDS.items()}
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        layer_types=tuple(kinds[k] for k in config.token_mixers),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel, rms_norm_eps=config.layernorm_epsilon,
        rope_theta=config.rope_theta, partial_rotary_factor=config.rotary_fraction,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, chunk_size=config.linear_chunk_size,
        extra={"rope_extra": {"rope_type": "default"}})


TRAINABLE_KINDS = ("gated_deltanet", "gated_attention")


def check_kinds(config, family: str, kinds=TRAINABLE_KINDS) -> None:
    bad = sorted(set(config.token_mixers or ("attention",)) - set(kinds))
    if bad:
        raise ValueError(f"a {family} model's token_mixers are {list(kinds)}; got {bad}")



def _pairs(config: TransformerConfig):
    """(megazoo name, single-device / transformers name) of the tensors mapped one to one."""
    yield WORD_EMBEDDINGS, "model.embed_tokens.weight"
    yield "final_norm.weight", "model.norm.weight"
    if not config.tie_word_embeddings:
        yield "head_weight", "lm_head.weight"
    for i, kind in enumerate(config.token_mixers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        yield m + "input_norm.weight", h + "input_layernorm.weight"
        yield m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"
        if kind == "gated_attention":
            for mz, name in (("dense", "o_proj"), ("q_norm", "q_norm"), ("k_norm", "k_norm")):
                yield m + f"attention.{mz}.weight", h + f"self_attn.{name}.weight"
        else:
            a = h + "linear_attn."
            yield m + "attention.conv_weight", a + "conv1d.weight"
            yield m + "attention.norm_weight", a + "norm.weight"
            yield m + "attention.out_proj.weight", a + "out_proj.weight"
            yield m + "attention.dt_bias", a + "dt_bias"
            yield m + "attention.A_log", a + "A_log"
        if not config.is_moe_layer(i):
            yield m + "mlp.fc2.weight", h + "mlp.down_proj.weight"


_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def layers_from_hf(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Single-device (Qwen3.5 names) tensors -> megazoo's, all but the MoE MLPs."""
    out = {mz: sd[name] for mz, name in _pairs(config)}
    heads, d = config.num_attention_heads, config.head_dim
    for i, kind in enumerate(config.token_mixers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        if kind == "gated_attention":
            q_proj = sd[h + "self_attn.q_proj.weight"]
            q, gate = q_proj.view(heads, 2 * d, -1).chunk(2, dim=1)
            out[m + "attention.qkv.weight"] = fuse_qkv(
                q.reshape(heads * d, -1), sd[h + "self_attn.k_proj.weight"],
                sd[h + "self_attn.v_proj.weight"], config.num_query_groups)
            out[m + "attention.gate.weight"] = gate.reshape(heads * d, -1)
        else:
            out[m + "attention.in_proj.weight"] = torch.cat(
                [sd[h + f"linear_attn.{p}.weight"] for p in _LINEAR])
        if not config.is_moe_layer(i):
            out[m + "mlp.fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"],
                                                   sd[h + "mlp.up_proj.weight"]])
    return out


def layers_to_hf(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """megazoo tensors -> single-device (Qwen3.5 names), all but the MoE MLPs."""
    out = {name: full[mz] for mz, name in _pairs(config)}
    heads, d = config.num_attention_heads, config.head_dim
    kd = config.linear_num_key_heads * config.linear_key_head_dim
    vd = config.linear_num_value_heads * config.linear_value_head_dim
    hv = config.linear_num_value_heads
    for i, kind in enumerate(config.token_mixers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        if kind == "gated_attention":
            q, k, v = split_qkv(full[m + "attention.qkv.weight"], config)
            gate = full[m + "attention.gate.weight"]
            out[h + "self_attn.q_proj.weight"] = torch.cat(
                [q.reshape(heads, d, -1), gate.reshape(heads, d, -1)], 1).reshape(2 * heads * d, -1)
            out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = k, v
        else:
            parts = full[m + "attention.in_proj.weight"].split([2 * kd + vd, vd, hv, hv])
            for p, t in zip(_LINEAR, parts):
                out[h + f"linear_attn.{p}.weight"] = t
        if not config.is_moe_layer(i):
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = \
                full[m + "mlp.fc1.weight"].chunk(2)
    return out
