"""Megatron-LM's legacy model (`--use-legacy-models`, megatron/legacy/model) state dicts in
Megatron-core names.

Megatron-LM's converter (tools/checkpoint, `--saver legacy`), GPT-3-era runs and the
Megatron-DeepSpeed lineage save the legacy GPTModel: a nested state dict

    language_model: {embedding: {word_embeddings: {weight}, position_embeddings: {weight}},
                     encoder: {layers.N.input_norm.weight, ..., final_norm.weight},
                     output_layer: {weight}}        untied head (last stage)
    word_embeddings_for_head: {weight}              tied head's copy on the last stage (pp > 1)

with `_extra_state` entries that are None. Per layer: `input_norm`, `self_attention.
query_key_value`, `self_attention.dense`, `post_attention_norm`, `mlp.dense_h_to_4h`,
`mlp.dense_4h_to_h` (older files: `input_layernorm`, `post_attention_layernorm`,
`final_layernorm`, `attention.` and `transformer` for `encoder`, which Megatron-LM's own loader
also accepts). Each maps one to one to a Megatron-core tensor of the same shape and TP split:
SwiGLU's `dense_h_to_4h` holds [gate_r; up_r] per rank like `linear_fc1`, and the fused QKV
rows are Megatron-core's from checkpoint_version 2.0 on (per query group [queries; key; value]).
Versions 0 and 1.0 kept each rank's rows as [3, heads, head_dim] and [heads, head_dim, 3];
they are reordered per rank as Megatron-LM's fix_query_key_value_ordering does.
"""
from __future__ import annotations

import re

import torch

from megazoo.training.checkpoint import format as ckpt

_LAYER = {  # legacy suffix after `layers.N.` -> Megatron-core suffix after `decoder.layers.N.`
    "input_norm": "input_layernorm", "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "post_attention_norm": "pre_mlp_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
    "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2",
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "encoder.final_norm.weight": "decoder.final_layernorm.weight",
    "encoder.final_norm.bias": "decoder.final_layernorm.bias",
    "encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}
KNOWN_VERSIONS = (0, 1.0, 2.0, 3.0)


def is_legacy_model(model: dict) -> bool:
    return isinstance(model, dict) and "language_model" in model


def _flatten(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _core_name(key: str, path: str) -> str | None:
    """The Megatron-core name of a flattened legacy key; None for `_extra_state` entries."""
    if key.endswith("._extra_state") or key == "_extra_state":
        return None
    if key == "word_embeddings_for_head.weight":
        return "output_layer.weight"  # the last stage's copy of the tied embedding
    if not key.startswith("language_model."):
        raise ckpt.CheckpointError(f"{path}: {key} is not a tensor of Megatron-LM's legacy GPT "
                                   f"model that megazoo maps (BERT, T5 and retro are not)")
    key = key[len("language_model."):]
    if key.startswith("transformer."):
        key = "encoder." + key[len("transformer."):]
    if key in _TOP:
        return _TOP[key]
    m = _LAYER_KEY.fullmatch(key[len("encoder."):]) if key.startswith("encoder.") else None
    module = m[2] if m else None
    if module and module.startswith("attention."):
        module = "self_" + module
    if module not in _LAYER:
        raise ckpt.CheckpointError(f"{path}: language_model.{key} is not a tensor of Megatron-LM's "
                                   f"legacy GPT model that megazoo maps")
    return f"decoder.layers.{m[1]}.{_LAYER[module]}.{m[3]}"


def fix_qkv(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (weight or bias) of checkpoint_version 0 / 1.0 in the
    per-head [q; k; v] order of version 2.0 on; `heads` is the rank's head count."""
    if version >= 2.0:
        return t
    rest = tuple(t.shape[1:])
    head_dim = t.shape[0] // (3 * heads)
    if version == 0:  # [3, heads, head_dim]
        t = t.reshape((3, heads, head_dim) + rest).transpose(0, 1)
    else:  # 1.0: [heads, head_dim, 3]
        t = t.reshape((heads, head_dim, 3) + rest).transpose(1, 2)
    return t.reshape((3 * heads * head_dim,) + rest).contiguous()


def checkpoint_version(sd: dict, path: str) -> float:
    """The file's QKV layout version (Megatron-LM reads a missing one as 0)."""
    version = sd.get("checkpoint_version", 0)
    if version not in KNOWN_VERSIONS:
        raise ckpt.CheckpointError(f"{path}: checkpoint_version {version!r} is none Megatron-LM "
                                   f"wrote ({', '.join(map(str, KNOWN_VERSIONS))})")
    return float(version)


def to_core(model: dict, version: float, heads_per_rank: int, path: str) -> dict:
    """A legacy stage state dict as a flat Megatron-core one (same order, tensors only)."""
    out = {}
    for key, value in _flatten(model):
        name = _core_name(key, path)
        if name is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ckpt.CheckpointError(f"{path}: {key} holds a {type(value).__name__}, "
                                       f"not a tensor")
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            value = fix_qkv(value, version, heads_per_rank)
        out[name] = value
    return out


def stage_models(sd: dict, vpp: int, path: str, heads_per_rank: int,
                 optimizer: bool = True) -> list[dict]:
    """The stage's model chunks in Megatron-core names (legacy-model files converted); with
    `optimizer`, a file of checkpoint_version 0 / 1.0 holding optimizer state is refused."""
    keys = ["model"] if vpp == 1 and "model" in sd else [f"model{v}" for v in range(vpp)]
    if not all(k in sd for k in keys):
        raise ckpt.CheckpointError(f"{path}: holds {sorted(k for k in sd if k.startswith('model'))}"
                                   f", the recorded virtual pipeline size {vpp} calls for {keys}")
    if not any(is_legacy_model(sd[k]) for k in keys):
        return [sd[k] for k in keys]
    version = checkpoint_version(sd, path)
    if version < 2.0 and optimizer and sd.get("optimizer") is not None:
        raise ckpt.CheckpointError(f"{path}: optimizer state of checkpoint_version {version} "
                                   f"(another QKV order) is not read; import with --no-optimizer")
    return [to_core(sd[k], version, heads_per_rank, path) for k in keys]
