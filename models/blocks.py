"""The transformer layer, built from the shared blocks (norms, attention, MLP).

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
from megazoo.parallel.topology import ParallelTopology

from .attention import KVCache, ParallelAttention, alibi_slopes  # noqa: F401 - re-exported
from .config import TransformerConfig
from .init import Initializer
from .mlp import ParallelMLP
from .mla import MultiLatentAttention
from .moe import MoELayer
from .norms import LayerNorm, RMSNorm, build_norm  # noqa: F401 - re-exported


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 layer_number: int, rng: RNGStreams | None):
        super().__init__()
        prefix = f"layers.{layer_number}."
        self.layer_number = layer_number
        self.topo, self.rng, self.dropout = topo, rng, config.hidden_dropout
        self.input_norm = build_norm(config, topo)
        attention = MultiLatentAttention if config.kv_lora_rank else ParallelAttention
        self.attention = attention(config, topo, init, prefix + "attention.", rng)
        self.post_attention_norm = build_norm(config, topo)
        mlp = MoELayer if config.is_moe_layer(layer_number) else ParallelMLP
        self.mlp = mlp(config, topo, init, prefix + "mlp.")

    def residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return x
        # Sequence-sharded activations differ per TP rank; replicated ones must drop alike.
        with self.rng.fork() if (self.rng is not None and self.topo.sequence_parallel) else contextlib.nullcontext():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, documents=None) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.input_norm(x), cache, self.layer_number,
                                                     documents))
        return x + self.residual_dropout(self.mlp(self.post_attention_norm(x)))
