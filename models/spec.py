"""What each layer of a model is made of, as data: the layer spec and the tables of kinds.

A model is the embedding, one `LayerSpec` per layer, the final norm and the head. A layer spec
names its norm kind, its token mixer (attention with its window, RoPE base and scaling, q/k norm,
sinks and softcap; or multi-head latent attention; later linear attention), its MLP (dense or
mixture of experts, with its activation) and whether norms also follow the mixer and the MLP
(Gemma's sandwich) and whether a learned scalar scales its output (Gemma 4). Alternating and hybrid layer patterns are therefore data, and the shared
blocks (models/blocks.py, norms.py, mlp.py, moe.py, attention.py) take their choices from the
spec through the tables here and the builder table in models/blocks.py, never by comparing a
family name or a string.

Tables of kinds (one entry adds a kind; an unknown name is an error naming the choices):

- `NORMS`: normalization name -> `NormKind` (RMSNorm or LayerNorm, with a bias, weight as
  (1 + w) as Gemma stores it)
- `ACTIVATIONS`: MLP activation name -> `Activation` (gated or not, and the function: for a
  gated MLP f(gate, up), else f(x))
- `MIXER_KINDS`: token mixer kinds, whose builders live in models/blocks.py `TOKEN_MIXERS`

`layer_spec(config, i)` derives layer i's spec from a `TransformerConfig`; a config exposes it as
`config.layer_spec(i)` and the derived properties `config.gated_mlp` and `config.norm_kind`.
This module imports only torch: models/config.py validates its fields against these tables.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def lookup(table: dict, name, what: str):
    """table[name], or a ValueError naming `what`, the value and the choices."""
    if name not in table:
        raise ValueError(f"{what} {name!r} is not supported; choose one of {sorted(table)}")
    return table[name]


# ---------------------------------------------------------------- norms
@dataclass(frozen=True)
class NormKind:
    rms: bool  # x / rms(x) (RMSNorm); else (x - mean) / std (LayerNorm)
    bias: bool  # a learned bias (LayerNorm's)
    offset: bool = False  # the weight is stored as w and applied as (1 + w) (Gemma)

    def parameters(self, size: int) -> int:
        return size * (2 if self.bias else 1)


NORMS: dict[str, NormKind] = {
    "layernorm": NormKind(rms=False, bias=True),
    "rmsnorm": NormKind(rms=True, bias=False),
    "rmsnorm_offset": NormKind(rms=True, bias=False, offset=True),
}


# ---------------------------------------------------------------- MLP activations
@dataclass(frozen=True)
class Activation:
    """An MLP's nonlinearity. Gated: fc1 is the fused [gate; up] projection (twice the width) and
    `fn(gate, up)` combines them; else `fn(x)`. `options`: config fields passed to `fn` by name
    (`bind`)."""
    gated: bool
    fn: Callable
    options: tuple[str, ...] = ()

    def bind(self, config) -> Callable:
        """`fn` with this config's options filled in."""
        if not self.options:
            return self.fn
        kwargs = {name: getattr(config, name) for name in self.options}
        return lambda *xs: self.fn(*xs, **kwargs)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def clamped_swiglu(gate, up, swiglu_alpha: float, swiglu_limit: float):
    """gpt-oss: gate clamped above at the limit, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    return gate * torch.sigmoid(gate * swiglu_alpha) * (up + 1)


ACTIVATIONS: dict[str, Activation] = {
    "gelu_tanh": Activation(False, _gelu_tanh),
    "gelu": Activation(False, F.gelu),
    "swiglu": Activation(True, lambda gate, up: F.silu(gate) * up),
    "geglu_tanh": Activation(True, lambda gate, up: _gelu_tanh(gate) * up),  # Gemma
    "swiglu_clamped": Activation(True, clamped_swiglu, ("swiglu_alpha", "swiglu_limit")),  # gpt-oss
    "relu2": Activation(False, lambda x: F.relu(x).square()),  # squared ReLU (Nemotron-H)
}


# ---------------------------------------------------------------- token mixers
# The kinds of token mixer a layer may hold; models/blocks.py TOKEN_MIXERS maps each to its
# builder (a new kind, e.g. linear attention, is one name here and one builder there).
# Hybrid stacks (docs/hybrid.md): Qwen3.5's gated attention (an output gate, partial RoPE), the
# linear-time Gated DeltaNet and Mamba-2, and "none" (a layer holding only its MLP).
MIXER_KINDS = ("attention", "mla", "gated_attention", "gated_deltanet", "mamba2", "none")


@dataclass(frozen=True)
class MixerSpec:
    """A layer's token mixer and its options (attention's; other kinds ignore what they lack)."""
    kind: str = "attention"
    window: int | None = None  # sliding window (a query sees itself and window - 1 keys before)
    rope_theta: float | None = None  # this layer's RoPE base (None: no rotary positions)
    rope_scaling: dict | None = dataclasses.field(default=None, hash=False)
    qk_norm: bool = False  # a norm over head_dim on each query and key head
    sinks: bool = False  # a learned per-head sink logit in the softmax (gpt-oss)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    scale: float | None = None  # softmax scale (None: 1 / sqrt(head_dim))
    v_norm: bool = False  # a weightless RMSNorm over head_dim on each value head (Gemma 4)
    head_dim: int | None = None  # this layer's own head size (None: the config's head_dim)
    kv_heads: int | None = None  # this layer's own key/value heads (None: the config's groups)
    k_eq_v: bool = False  # keys projected only; values are the key projection's output (before
    #                       the key norm and RoPE), then the value norm (Gemma 4's full layers)
    kv_source: int | None = None  # no keys/values of its own: those of this (earlier) layer
    kv_sink: bool = False  # later layers attend with this layer's keys and values (KV sharing)


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "dense"  # dense | moe
    activation: str = "gelu_tanh"  # a key of ACTIVATIONS
    width: int | None = None  # this layer's dense MLP width (None: the config's ffn_hidden_size)

    @property
    def gated(self) -> bool:
        return lookup(ACTIVATIONS, self.activation, "activation").gated

    @property
    def residual_input(self) -> bool:
        """Whether the MLP also takes the layer's un-normed input (its router and experts norm
        it their own way)."""
        return self.kind in MLP_RESIDUAL_INPUT


# none: a layer holding only its token mixer; dense_moe: a dense MLP and routed experts side by
# side (Gemma 4's MoE block), which also reads the layer's un-normed input (MLP_RESIDUAL_INPUT)
MLP_KINDS = ("dense", "moe", "none", "dense_moe")
MLP_RESIDUAL_INPUT = ("dense_moe",)  # kinds called as mlp(normed input, residual stream)


@dataclass(frozen=True)
class LayerSpec:
    norm: str  # a key of NORMS, for every norm of the layer
    mixer: MixerSpec
    mlp: MLPSpec
    post_norms: bool = False  # norms after the mixer and the MLP too, before each residual add
    scalar: bool = False  # a learned scalar multiplying the layer's output, residual included
    per_layer_input: int = 0  # the size of its own per-token input (models/per_layer_inputs.py),
    #                           added after the MLP through a gate and a projection; 0: none

    def check(self) -> "LayerSpec":
        lookup(NORMS, self.norm, "normalization")
        lookup(dict.fromkeys(MIXER_KINDS), self.mixer.kind, "token mixer")
        lookup(dict.fromkeys(MLP_KINDS), self.mlp.kind, "MLP kind")
        lookup(ACTIVATIONS, self.mlp.activation, "activation")
        return self


def layer_spec(config, layer: int) -> LayerSpec:
    """Global layer `layer`'s spec from a TransformerConfig's fields (the MTP depths' layers,
    numbered after the main ones, follow the same rules)."""
    window = config.attention_window(layer)
    theta, scaling = config.rope_of(layer) if config.position_embedding == "rope" else (None, None)
    kind = "mla" if config.kv_lora_rank else "attention"
    if config.token_mixers is not None and layer < len(config.token_mixers):
        kind = config.token_mixers[layer]  # (the MTP depths' layers, after them, attend)
    mixer = MixerSpec(
        kind=kind, window=window,
        rope_theta=theta, rope_scaling=scaling, qk_norm=config.qk_layernorm,
        sinks=config.attention_sinks, softcap=config.attn_logit_softcapping,
        v_norm=config.value_norm,
        head_dim=config.global_kv_channels if window is None else None,
        kv_heads=config.global_num_query_groups if window is None else None,
        k_eq_v=config.attention_k_eq_v and window is None,
        kv_source=config.kv_source(layer), kv_sink=layer in config.kv_producers(),
        scale=None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5)
    mlp_kind = ("dense_moe" if config.moe_with_dense_mlp else "moe") \
        if config.is_moe_layer(layer) else "dense"
    if config.layer_mlps is not None and layer < len(config.layer_mlps):
        mlp_kind = config.layer_mlps[layer]
    width = config.layer_ffn_hidden_size(layer)
    mlp = MLPSpec(kind=mlp_kind, activation=config.activation,
                  width=None if width == config.ffn_hidden_size else width)
    return LayerSpec(norm=config.normalization, mixer=mixer, mlp=mlp,
                     post_norms=config.post_norms, scalar=config.layer_scalar,
                     per_layer_input=config.per_layer_input_size if layer < config.num_layers
                     else 0).check()
