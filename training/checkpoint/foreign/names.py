"""Megatron-core tensor names <-> megazoo canonical names, and how each is split over TP.

Megatron-LM's legacy files (`model_optim_rng.pt`) and torch_dist checkpoints use the same
Megatron-core module names; per layer they differ only in where the layer index goes
(`decoder.layers.{i}.` per stage in legacy files; one tensor stacked over layers, or per layer,
in torch_dist). The fused tensors already have megazoo's orders: QKV rows per query group
[group's queries; key; value] (per head [q; k; v] without grouping), SwiGLU `linear_fc1` rows
[gate; up]. Over TP ranks Megatron splits QKV into contiguous chunks (whole groups per rank) and
`linear_fc1` as [gate_r; up_r] on rank r (each half split separately).

Split kinds: "column" (dim 0 in chunks), "glu" (dim 0, each of [gate; up] in chunks), "row"
(dim 1), "vocab" (dim 0, padded to a multiple of the vocabulary divisor times TP), "replicated",
"down" (MLA's down-projections: replicated or column by the spec, megatron_mla.down_split).
"""
from __future__ import annotations

import re

import torch

from megazoo.parallel.tensor_parallel import StridedLayout
from megazoo.training.checkpoint.foreign import megatron_mla

# (Megatron-core suffix after `decoder.layers.{i}.`, megazoo suffix after `layers.{i}.`, split).
# Transformer Engine's specs fuse the norms into the next linear (`layer_norm_weight`); the local
# spec keeps them apart; both map to the same megazoo norm.
LAYER = (  # in Megatron-core's module order (the optimizer numbers parameters in it)
    ("input_layernorm.weight", "input_norm.weight", "replicated"),
    ("input_layernorm.bias", "input_norm.bias", "replicated"),
    ("self_attention.linear_proj.weight", "attention.dense.weight", "row"),
    ("self_attention.linear_proj.bias", "attention.dense.bias", "replicated"),
    *megatron_mla.LAYER,  # multi-latent attention's projections and latent norms
    ("self_attention.linear_qkv.layer_norm_weight", "input_norm.weight", "replicated"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_norm.bias", "replicated"),
    ("self_attention.linear_qkv.weight", "attention.qkv.weight", "column"),
    ("self_attention.linear_qkv.bias", "attention.qkv.bias", "column"),
    ("self_attention.q_layernorm.weight", "attention.q_norm.weight", "replicated"),
    ("self_attention.k_layernorm.weight", "attention.k_norm.weight", "replicated"),
    ("pre_mlp_layernorm.weight", "post_attention_norm.weight", "replicated"),
    ("pre_mlp_layernorm.bias", "post_attention_norm.bias", "replicated"),
    ("mlp.router.weight", "mlp.router", "replicated"),
    # MoE layers (megatron_moe.py): the router's expert bias (a buffer: no optimizer state) and
    # the shared expert, an ordinary TP MLP with an optional sigmoid gate
    ("mlp.router.expert_bias", "mlp.expert_bias", "replicated"),
    ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate", "replicated"),
    ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert.fc1.weight", "glu"),
    ("mlp.shared_experts.linear_fc1.bias", "mlp.shared_expert.fc1.bias", "glu"),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.fc2.weight", "row"),
    ("mlp.shared_experts.linear_fc2.bias", "mlp.shared_expert.fc2.bias", "replicated"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_norm.weight", "replicated"),
    ("mlp.linear_fc1.layer_norm_bias", "post_attention_norm.bias", "replicated"),
    ("mlp.linear_fc1.weight", "mlp.fc1.weight", "glu"),
    ("mlp.linear_fc1.bias", "mlp.fc1.bias", "glu"),
    ("mlp.linear_fc2.weight", "mlp.fc2.weight", "row"),
    ("mlp.linear_fc2.bias", "mlp.fc2.bias", "replicated"),
)
# Routed experts: megazoo stacks them ([experts, ...] under one name); Megatron keeps one module
# per expert (SequentialMLP `local_experts.{e}`) or one tensor per expert (TEGroupedMLP `weight{e}`).
EXPERT = (
    ("linear_fc1.weight", "mlp.experts.weight1", "glu"),
    ("linear_fc1.bias", "mlp.experts.bias1", "glu"),
    ("linear_fc2.weight", "mlp.experts.weight2", "row"),
    ("linear_fc2.bias", "mlp.experts.bias2", "replicated"),
)
TOP = (
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", "vocab"),
    ("embedding.position_embeddings.weight", "embedding.position_embeddings.weight", "replicated"),
    ("decoder.final_layernorm.weight", "final_norm.weight", "replicated"),
    ("decoder.final_layernorm.bias", "final_norm.bias", "replicated"),
    ("output_layer.weight", "head_weight", "vocab"),
)
# Megatron-core keys that hold no weights: TE's FP8 metadata, RoPE's inverse frequencies.
IGNORED = re.compile(r".*(\._extra_state|rotary_pos_emb\.inv_freq)$")

_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_KEY = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(.+)|(linear_fc[12]\.(?:weight|bias))(\d+))")
_BY_MEGATRON = {m: (z, s) for m, z, s in LAYER}
_MLA_ROWS = range(LAYER.index(megatron_mla.LAYER[0]),
                  LAYER.index(megatron_mla.LAYER[0]) + len(megatron_mla.LAYER))
_MLA_KEYS = {m for m, _, _ in megatron_mla.LAYER}
_BY_EXPERT = {m: (z, s) for m, z, s in EXPERT}
_TOP = {m: (z, s) for m, z, s in TOP}


def to_megazoo(key: str, layer_offset: int = 0):
    """(megazoo canonical name, split, expert index or None) of a Megatron-core key in one stage's
    state dict whose layers start at `layer_offset`; None for keys holding no weights."""
    if IGNORED.fullmatch(key):
        return None
    if key in _TOP:
        return (*_TOP[key], None)
    if key.startswith("mtp.layers."):  # multi-token prediction depths (megatron_mla.MTP)
        return megatron_mla.mtp_to_megazoo(key, to_megazoo)
    m = _LAYER_KEY.fullmatch(key)
    if m is None:
        raise KeyError(key)
    layer, rest = int(m[1]) + layer_offset, m[2]
    if rest in _BY_MEGATRON:
        name, split = _BY_MEGATRON[rest]
        return f"layers.{layer}.{name}", split, None
    e = _EXPERT_KEY.fullmatch(rest)
    if e is None or (e[2] or e[3]) not in _BY_EXPERT:
        raise KeyError(key)
    name, split = _BY_EXPERT[e[2] or e[3]]
    return f"layers.{layer}.{name}", split, int(e[1] if e[1] is not None else e[4])


def layer_keys(local: int, megazoo_suffixes, *, te_norms: bool = False):
    """Megatron-core keys of one layer (local index `local`) for the megazoo suffixes it has:
    [(megatron key, megazoo suffix, split)] in Megatron-core's module order; the norms under
    Transformer Engine's fused names with `te_norms`, else the local spec's."""
    wanted = set(megazoo_suffixes)
    # MLA's rows in its module order; q_layernorm is also Qwen3's, after linear_qkv
    mla = "attention.kv_down" in wanted
    out = []
    for i, (m, z, s) in enumerate(LAYER):
        if (i in _MLA_ROWS) != mla and m in _MLA_KEYS:
            continue
        fused = ".layer_norm_" in m
        plain = m.startswith(("input_layernorm", "pre_mlp_layernorm"))
        if z in wanted and not (plain if te_norms else fused):
            out.append((f"decoder.layers.{local}.{m}", z, s))
    return out


def expert_keys(local: int, expert: int, megazoo_suffixes):
    """SequentialMLP keys of one local expert: [(megatron key, megazoo suffix, split)]."""
    return [(f"decoder.layers.{local}.mlp.experts.local_experts.{expert}.{m}", z, s)
            for m, z, s in EXPERT if z in set(megazoo_suffixes)]


def shard(full: torch.Tensor, split: str, rank: int, tp: int, padded: int | None = None):
    """Rank `rank`'s part of a full tensor as Megatron stores it."""
    if split == "replicated" or tp == 1 and split != "vocab":
        return full
    if split == "vocab":
        pad = padded - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros((pad,) + tuple(full.shape[1:]))])
        return full.chunk(tp, 0)[rank]
    if split == "glu":
        return StridedLayout(2).shard(full, 0, rank, tp)
    return full.chunk(tp, 0 if split == "column" else 1)[rank]


def unshard(parts: list[torch.Tensor], split: str, full_rows: int | None = None) -> torch.Tensor:
    """The full tensor from every TP rank's part (rank order); `full_rows` trims vocab padding.
    Replicated parts are returned as a list's first; the caller averages drifted copies."""
    if split == "replicated":
        return parts[0]
    if split == "glu":
        return StridedLayout(2).unshard(parts, 0) if len(parts) > 1 else parts[0]
    joined = torch.cat(parts, 1 if split == "row" else 0)
    return joined[:full_rows] if split == "vocab" and full_rows else joined


def split_for(split: str, swiglu: bool) -> str:
    """A plain (GELU) `linear_fc1` is split like any column-parallel tensor."""
    return "column" if split == "glu" and not swiglu else split
