"""The transformer layer, built from its layer spec (models/spec.py) out of the shared blocks.

The spec's kinds choose the builders from the tables below: `TOKEN_MIXERS` (token mixer kind ->
module class taking (config, topo, init, prefix, rng, spec)) and `MLPS` (MLP kind -> module class
taking (config, topo, init, prefix, activation)); a new kind is one entry in models/spec.py's
kind list and one here.

Activations are [sequence, batch, hidden]; under sequence parallelism the sequence dimension is
sharded over TP ranks outside attention and MLP. Communication happens only inside the parallel
layers imported from `parallel/`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.random import RNGStreams
from megazoo.parallel.tensor_parallel import sequence_parallel_param
from megazoo.parallel.topology import ParallelTopology

from .attention import KVCache, ParallelAttention, alibi_slopes  # noqa: F401 - re-exported
from .config import TransformerConfig
from .init import Initializer
from .mlp import ParallelMLP
from .mla import MultiLatentAttention
from .moe import MoELayer
from .dense_moe import DenseAndExperts
from .gated_attention import GatedAttention
from .linear_mixers import ParallelGatedDeltaNet, ParallelMamba2
from .norms import LayerNorm, RMSNorm, build_norm  # noqa: F401 - re-exported
from .per_layer_inputs import PER_LAYER_ACTIVATION
from .spec import ACTIVATIONS, MIXER_KINDS, MLP_KINDS, LayerSpec, lookup


def _latent_attention(config, topo, init, prefix, rng, spec):
    return MultiLatentAttention(config, topo, init, prefix, rng)


def _moe(config, topo, init, prefix, activation):
    return MoELayer(config, topo, init, prefix)


def _absent(*_args):
    return None  # a layer without this part (Nemotron-H's single-mixer layers)


TOKEN_MIXERS = {"attention": ParallelAttention, "mla": _latent_attention,
                "gated_attention": GatedAttention, "gated_deltanet": ParallelGatedDeltaNet,
                "mamba2": ParallelMamba2, "none": _absent}
MLPS = {"dense": ParallelMLP, "moe": _moe, "none": _absent, "dense_moe": DenseAndExperts}
assert tuple(TOKEN_MIXERS) == MIXER_KINDS and tuple(MLPS) == MLP_KINDS, "models/spec.py's kinds"


def _replicated(config, topo, init, name: str, shape: tuple[int, int]) -> nn.Parameter:
    """A TP-replicated weight, initialised like the others of its name."""
    t = torch.empty(shape)
    init.normal(name)(t)
    return nn.Parameter(t.to(device=topo.device, dtype=config.dtype))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(mixer(norm(x))), then x + drop(mlp(norm(x))); with the spec's
    post_norms a norm also follows the mixer and the MLP (before each residual add); with its
    scalar the output (residual included) is multiplied by a learned per-layer scalar."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 layer_number: int, rng: RNGStreams | None, spec: LayerSpec | None = None):
        super().__init__()
        prefix = f"layers.{layer_number}."
        self.spec = spec = spec or config.layer_spec(layer_number)
        self.layer_number = layer_number
        self.topo, self.rng, self.dropout = topo, rng, config.hidden_dropout
        # a "none" mixer or MLP (a single-mixer layer, Nemotron-H) has no norm before it either
        self.input_norm = None if spec.mixer.kind == "none" else build_norm(config, topo)
        mixer = lookup(TOKEN_MIXERS, spec.mixer.kind, "token mixer")
        self.attention = mixer(config, topo, init, prefix + "attention.", rng, spec.mixer)
        self.post_attention_norm = None if spec.mlp.kind == "none" else build_norm(config, topo)
        mlp = lookup(MLPS, spec.mlp.kind, "MLP kind")
        wide = config if spec.mlp.width is None else config.replace(ffn_hidden_size=spec.mlp.width)
        self.mlp = mlp(wide, topo, init, prefix + "mlp.", spec.mlp.activation)
        self.attention_output_norm = self.mlp_output_norm = None
        if spec.post_norms:
            self.attention_output_norm = build_norm(config, topo)
            self.mlp_output_norm = build_norm(config, topo)
        # Gemma 4: the layer's own per-token input, gated by x and projected back after the MLP
        # (models/per_layer_inputs.py; TP-replicated weights)
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if spec.per_layer_input:
            self.per_layer_act = lookup(ACTIVATIONS, PER_LAYER_ACTIVATION, "activation").bind(config)
            self.per_layer_input_gate = _replicated(config, topo, init, prefix + "per_layer_input_gate",
                                                    (spec.per_layer_input, config.hidden_size))
            self.per_layer_projection = _replicated(config, topo, init, prefix + "per_layer_projection",
                                                    (config.hidden_size, spec.per_layer_input))
            self.post_per_layer_input_norm = build_norm(config, topo)
        # Gemma 4: one learned scalar times the layer's output (TP-replicated, like a norm weight)
        self.layer_scalar = None
        if spec.scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1, device=topo.device, dtype=config.dtype))

    def residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return x
        # Sequence-sharded activations differ per TP rank; replicated ones must drop alike.
        with self.rng.fork() if (self.rng is not None and self.topo.sequence_parallel) else contextlib.nullcontext():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, documents=None,
                shared: dict | None = None, per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """`shared`: keys and values reused by later layers (KV sharing), per forward;
        `per_layer` [s, b, p]: this layer's own input (with `spec.per_layer_input`)."""
        if self.attention is not None:
            mixer = self.spec.mixer  # (only attention layers share keys and values)
            extra = {"shared": shared} if mixer.kv_sink or mixer.kv_source is not None else {}
            y = self.attention(self.input_norm(x), cache, self.layer_number, documents, **extra)
            if self.attention_output_norm is not None:
                y = self.attention_output_norm(y)
            x = x + self.residual_dropout(y)
        if self.mlp is not None:
            normed = self.post_attention_norm(x)
            y = self.mlp(normed, x) if self.spec.mlp.residual_input else self.mlp(normed)
            if self.mlp_output_norm is not None:
                y = self.mlp_output_norm(y)
            x = x + self.residual_dropout(y)
        if self.per_layer_input_gate is not None:
            gate = F.linear(x, sequence_parallel_param(self.per_layer_input_gate, self.topo))
            y = F.linear(self.per_layer_act(gate) * per_layer,
                         sequence_parallel_param(self.per_layer_projection, self.topo))
            x = x + self.residual_dropout(self.post_per_layer_input_norm(y))
        if self.layer_scalar is not None:
            x = x * sequence_parallel_param(self.layer_scalar, self.topo)
        return x
