"""Gemma's tensors <-> transformers, shared by the Gemma 3 and Gemma 4 text family folders: the
embedding, four norms per layer (before and after attention and MLP) and the q/k norms mapped one
to one, q/k/v fused per key/value group as megazoo's attention holds them (each layer at its own
head size: Gemma 4's full layers may have a wider one), gate and up fused as [gate; up], and each
layer's stored output scalar where the config has one (Gemma 4). Also the two configs' shared
fields: each layer's type and the RoPE of each type, read (`layers_from_hf`, `rope_from_hf`) and
written (`hf_layer_fields`)."""
from __future__ import annotations

import torch

from .config import ROPE_TYPES, TransformerConfig, canonical_rope_scaling
from .hf_fields import refuse
from .language_model import WORD_EMBEDDINGS
from .rope import rope_type

NORMS = (("input_norm", "input_layernorm"), ("attention_output_norm", "post_attention_layernorm"),
         ("post_attention_norm", "pre_feedforward_layernorm"),
         ("mlp_output_norm", "post_feedforward_layernorm"),
         ("attention.q_norm", "self_attn.q_norm"), ("attention.k_norm", "self_attn.k_norm"))

LAYER_TYPES = ("sliding_attention", "full_attention")
TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh")  # ACT2FN's tanh-approximated GELU names


def layers_from_hf(hf, family: str) -> tuple[tuple[int, ...], int | None]:
    """(full-attention layers, sliding window or None when no layer slides) of a Gemma 3 / Gemma 4
    text HF config; `layer_types` other than one known type per layer refused."""
    types = list(hf.layer_types)
    if len(types) != hf.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise refuse(family, "layer_types", types,
                     f"{hf.num_hidden_layers} entries of {list(LAYER_TYPES)}")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    return full, (hf.sliding_window if len(full) < len(types) else None)


def rope_from_hf(hf, family: str, partial: tuple[str, ...] = ()) -> tuple[float, dict | None, float]:
    """(full layers' rope_theta, their scaling or None, sliding layers' theta) of a Gemma 3 /
    Gemma 4 text HF config's `rope_parameters`; `partial`: the full layers' rope types that may
    rotate part of the head (partial_rotary_factor), none unless named."""
    params = hf.rope_parameters or {}
    full = dict(canonical_rope_scaling(params.get("full_attention")) or {})
    local = dict(canonical_rope_scaling(params.get("sliding_attention")) or {})
    theta, local_theta = full.pop("rope_theta", 1e6), local.pop("rope_theta", 1e4)
    if rope_type(local) != "default" or set(local) - {"rope_type"}:
        raise refuse(family, "rope_parameters.sliding_attention", params.get("sliding_attention"),
                     "rope_type 'default' with a rope_theta (sliding layers rotate unscaled)")
    kind = rope_type(full)
    if kind not in ROPE_TYPES or (kind not in partial
                                  and full.get("partial_rotary_factor", 1.0) != 1.0):
        rotated = (f"partial_rotary_factor with {' or '.join(map(repr, partial))} only" if partial
                   else "the whole head rotated")
        raise refuse(family, "rope_parameters.full_attention", params.get("full_attention"),
                     f"rope_type one of {list(ROPE_TYPES)}, {rotated}")
    return float(theta), (full if kind != "default" else None), float(local_theta)


def hf_layer_fields(config: TransformerConfig) -> dict:
    """`layer_types` and `rope_parameters` of a Gemma 3 / Gemma 4 text HF config: each layer
    sliding or full, the full layers' RoPE (scaling and theta), the sliding layers' theta
    unscaled (`rope_local_theta`, else the full layers')."""
    types = ["full_attention" if config.attention_window(i) is None else "sliding_attention"
             for i in range(config.num_layers)]
    full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    local_theta = config.rope_local_theta if config.rope_local_theta is not None \
        else config.rope_theta
    return {"layer_types": types,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": local_theta}}}


def _pairs(config: TransformerConfig):
    """(megazoo name, HF name) of the tensors mapped one to one."""
    yield WORD_EMBEDDINGS, "model.embed_tokens.weight"
    yield "final_norm.weight", "model.norm.weight"
    if not config.tie_word_embeddings:
        yield "head_weight", "lm_head.weight"
    for i in range(config.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        for mz, hf in NORMS:
            if mz == "attention.k_norm" and config.kv_source(i) is not None:
                continue  # (KV sharing: no keys of its own)
            yield m + mz + ".weight", h + hf + ".weight"
        yield m + "attention.dense.weight", h + "self_attn.o_proj.weight"
        yield m + "mlp.fc2.weight", h + "mlp.down_proj.weight"
        if config.layer_scalar:
            yield m + "layer_scalar", h + "layer_scalar"


def _projections(config: TransformerConfig, layer: int) -> tuple[int, str]:
    """(key/value heads, the HF projections fused) of layer `layer`: "qkv", "qk" where the values
    are the key projection's output (Gemma 4's attention_k_eq_v full layers), or "q" where an
    earlier layer's keys and values are reused (KV sharing)."""
    mixer = config.layer_spec(layer).mixer
    names = "q" if mixer.kv_source is not None else "qk" if mixer.k_eq_v else "qkv"
    return mixer.kv_heads or config.num_query_groups, names


def _split_qkv(t: torch.Tensor, config: TransformerConfig, layer: int) -> dict[str, torch.Tensor]:
    """The fused [q heads of the group, k(, v)] per group rows -> HF q, k(, v) (the layer's head
    size and key/value heads)."""
    (groups, names), d = _projections(config, layer), config.layer_head_dim(layer)
    q_rows = config.num_attention_heads // groups * d
    parts = t.reshape(groups, -1, *t.shape[1:]).split([q_rows] + [d] * (len(names) - 1), dim=1)
    return {x: p.reshape(-1, *t.shape[1:]) for x, p in zip(names, parts)}


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF Gemma*ForCausalLM tensors -> full megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = {mz: sd[hf] for mz, hf in _pairs(config)}
    for i in range(config.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        groups, names = _projections(config, i)
        per = [sd[h + f"self_attn.{x}_proj.weight"] for x in names]  # (any head size)
        out[m + "attention.qkv.weight"] = torch.cat(
            [t.reshape(groups, -1, *t.shape[1:]) for t in per], dim=1).reshape(-1, per[0].shape[1])
        out[m + "mlp.fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"],
                                               sd[h + "mlp.up_proj.weight"]])
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF Gemma*ForCausalLM tensors (no lm_head when tied)."""
    out = {hf: full[mz] for mz, hf in _pairs(config)}
    for i in range(config.num_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        for x, t in _split_qkv(full[m + "attention.qkv.weight"], config, i).items():
            out[h + f"self_attn.{x}_proj.weight"] = t
        gate, up = full[m + "mlp.fc1.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}
