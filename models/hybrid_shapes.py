"""Hybrid models described as data, for counting (models/hybrid_counts.py) and planning
(training/planning/hybrid.py).

A hybrid config (Qwen3.5 and Qwen3-Next's `Qwen35Config`, Nemotron-H's `NemotronHConfig`, a
`TransformerConfig` whose `token_mixers` name hybrid layer kinds, or anything exposing the same
shape properties) becomes a `HybridShape` (`describe`): one `HybridLayer` per layer holding its
token mixer (`GatedDeltaNetShape`, `Mamba2Shape`, `AttentionShape` or none) and its MLP
(`DenseMLP`, `MoEMLP` or none). The config is read by its properties (`linear_shape`,
`mamba_shape`, `layer_types`, `is_moe_layer`), so this module imports no family.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = False  # Qwen3.5: q_proj gives [query | gate] per head, output times sigmoid(gate)
    qk_norm: bool = False
    bias: bool = False


@dataclass(frozen=True)
class DenseMLP:
    size: int
    gated: bool  # SwiGLU (gate, up, down) or squared ReLU (up, down)
    bias: bool = False


@dataclass(frozen=True)
class MoEMLP:
    experts: int
    topk: int
    size: int  # each routed expert's width
    shared: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False
    gated: bool = True  # SwiGLU experts (gate, up, down) or squared ReLU (up, down: Nemotron-H)

    @property
    def mats(self) -> int:
        """Weight matrices per expert (and in the shared expert)."""
        return 3 if self.gated else 2


@dataclass(frozen=True)
class HybridLayer:
    mixer: object | None  # GatedDeltaNetShape | Mamba2Shape | AttentionShape | None
    mlp: object | None  # DenseMLP | MoEMLP | None
    norms: int  # RMSNorms of width h in the layer

    @property
    def kind(self) -> str:
        """"gated_deltanet", "mamba2", "attention" or "mlp" (a layer without a token mixer)."""
        return MIXER_NAMES.get(type(self.mixer).__name__, "mlp")


MIXER_NAMES = {"GatedDeltaNetShape": "gated_deltanet", "Mamba2Shape": "mamba2",
               "AttentionShape": "attention"}


@dataclass(frozen=True)
class HybridShape:
    vocab_size: int
    hidden_size: int
    tie_word_embeddings: bool
    layers: tuple[HybridLayer, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)


HYBRID_MIXERS = frozenset({"gated_deltanet", "mamba2", "gated_attention", "none"})


def is_hybrid(c) -> bool:
    """Whether `c` describes a hybrid stack: a family config of Qwen3.5 / Qwen3-Next / Nemotron-H,
    or a `TransformerConfig` whose `token_mixers` name one of the hybrid layer kinds."""
    return hasattr(c, "mamba_shape") or hasattr(c, "linear_shape") or \
        bool(HYBRID_MIXERS & set(getattr(c, "token_mixers", None) or ()))


def describe(c) -> HybridShape:
    """The layer-kind description of a Qwen3.5 / Qwen3-Next (`linear_shape`) or Nemotron-H
    (`mamba_shape`) family config, or of a `TransformerConfig` with hybrid `token_mixers`
    (`_layer_specs`); a config of neither kind is refused in one line."""
    if getattr(c, "token_mixers", None) and is_hybrid(c):
        return _layer_specs(c)
    if hasattr(c, "mamba_shape"):
        return _nemotron_h(c)
    if hasattr(c, "linear_shape"):
        return _qwen35(c)
    raise ValueError(f"{type(c).__name__} is not a hybrid config (no linear_shape or mamba_shape); "
                     f"the hybrid planner takes Qwen3.5, Qwen3-Next and Nemotron-H configs")


def _qwen35(c) -> HybridShape:
    attn = AttentionShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, gated=True,
                          qk_norm=True, bias=c.attention_bias)
    layers = []
    for i, kind in enumerate(c.layer_types):
        mixer = c.linear_shape if kind == "linear_attention" else attn
        moe = getattr(c, "is_moe_layer", None)
        mlp = MoEMLP(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                     c.shared_expert_intermediate_size, shared_gate=True) \
            if moe is not None and moe(i) else DenseMLP(c.intermediate_size, gated=True)
        layers.append(HybridLayer(mixer, mlp, norms=2))
    return HybridShape(c.vocab_size, c.hidden_size, c.tie_word_embeddings, tuple(layers))


def _nemotron_h(c) -> HybridShape:
    attn = AttentionShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          bias=c.attention_bias)
    mlp = DenseMLP(c.intermediate_size, gated=False, bias=c.mlp_bias)
    kinds = {"linear_attention": (c.mamba_shape, None), "full_attention": (attn, None),
             "mlp": (None, mlp)}
    layers = tuple(HybridLayer(*kinds[k], norms=1) for k in c.layer_types)
    return HybridShape(c.vocab_size, c.hidden_size, c.tie_word_embeddings, layers)


def _layer_specs(c) -> HybridShape:
    """A TransformerConfig's hybrid stack: per layer its token mixer kind (`token_mixers`:
    gated_deltanet, mamba2, gated_attention, attention or none) and MLP kind (`layer_mlps`:
    dense, moe or none; else MoE where `is_moe_layer` says), with the linear_* / mamba_* shape
    fields; a layer holding a mixer and an MLP has two norms, a single-mixer layer one."""
    from .gated_deltanet import GatedDeltaNetShape
    from .mamba2 import Mamba2Shape
    h = c.hidden_size
    gdn = GatedDeltaNetShape(h, c.linear_num_key_heads, c.linear_num_value_heads,
                             c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel,
                             c.layernorm_epsilon, c.linear_chunk_size) \
        if c.linear_num_key_heads else None
    mamba = Mamba2Shape(h, c.mamba_num_heads, c.mamba_head_dim, c.mamba_state_size,
                        c.mamba_groups, c.linear_conv_kernel, c.layernorm_epsilon,
                        c.linear_chunk_size, c.mamba_time_step_min, c.mamba_conv_bias,
                        c.mamba_proj_bias) if c.mamba_num_heads else None

    def attention(gated: bool) -> AttentionShape:
        return AttentionShape(c.num_attention_heads, c.num_query_groups, c.head_dim, gated=gated,
                              qk_norm=c.qk_layernorm, bias=bool(c.bias or c.add_qkv_bias))

    mixers = {"gated_deltanet": gdn, "mamba2": mamba, "gated_attention": attention(True),
              "attention": attention(False), "none": None}
    gated = c.gated_mlp
    layers = []
    for i, kind in enumerate(c.token_mixers):
        mlp_kind = c.layer_mlps[i] if getattr(c, "layer_mlps", None) else (
            "moe" if c.is_moe_layer(i) else "dense")
        mlp = None if mlp_kind == "none" else DenseMLP(c.ffn_hidden_size, gated, bool(c.bias)) \
            if mlp_kind == "dense" else MoEMLP(c.num_experts, c.moe_router_topk,
                                               c.moe_ffn_hidden_size,
                                               c.moe_shared_expert_intermediate_size or 0,
                                               c.moe_shared_expert_gate, gated)
        mixer = mixers[kind]
        layers.append(HybridLayer(mixer, mlp, norms=2 if (mixer is not None and mlp is not None) else 1))
    return HybridShape(c.vocab_size, h, c.tie_word_embeddings, tuple(layers))
