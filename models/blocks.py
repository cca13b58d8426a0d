"""Shared transformer blocks built from tensor-parallel layers.

Activations are [sequence, batch, hidden]; under sequence parallelism the sequence dimension is
sharded over TP ranks outside attention and MLP. Communication happens only inside the parallel
layers imported from `parallel/`.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from parallel.random import RNGStreams
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, sequence_parallel_param
from parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer


class LayerNorm(nn.Module):
    """LayerNorm whose replicated weights see a sequence shard under sequence parallelism."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, *, in_sequence_region=True):
        super().__init__()
        h = config.hidden_size
        self.eps, self.topo, self.in_sequence_region = config.layernorm_epsilon, topo, in_sequence_region
        self.weight = nn.Parameter(torch.ones(h, device=topo.device, dtype=config.dtype))
        self.bias = nn.Parameter(torch.zeros(h, device=topo.device, dtype=config.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.in_sequence_region:
            w, b = sequence_parallel_param(w, self.topo), sequence_parallel_param(b, self.topo)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes (Press et al. 2022) for any head count, the standard interleaving for
    non-powers of two: the closest power of two's geometric series, then every other slope
    of the series for twice as many heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra_base = 2.0 ** (-4.0 / closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def causal_bias(slopes: torch.Tensor | None, q_len: int, k_len: int, dtype, device) -> torch.Tensor:
    """Additive attention bias [heads or 1, q, k]: -inf where key > query (queries are the last
    q_len of k_len positions, as when decoding with a KV cache), plus ALiBi's slope * (key - query)
    where slopes are given."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    distance = (torch.arange(k_len, device=device)[None, :] - q_pos[:, None]).to(torch.float32)
    bias = distance.new_zeros(distance.shape)[None] if slopes is None \
        else slopes.to(device)[:, None, None] * distance
    return bias.masked_fill(distance > 0, float("-inf")).to(dtype)


class KVCache:
    """Keys and values of earlier positions, per layer, for incremental decoding.

    `offset` is the number of positions already cached; the model advances it after each forward.
    Tensors are [b, heads_local, positions, head_dim] (this TP rank's heads only).
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.offset = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class ParallelAttention(nn.Module):
    """Causal self-attention; heads split over TP ranks; fused QKV in [heads, 3, head_dim] order."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str, rng: RNGStreams | None):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.heads_local, self.head_dim = heads // topo.tp, config.head_dim
        self.dropout, self.rng = config.attention_dropout, rng
        self.qkv = ColumnParallelLinear(h, 3 * h, topo, init.normal(prefix + "qkv.weight"),
                                        bias=config.bias, dtype=config.dtype)
        self.dense = RowParallelLinear(h, h, topo, init.scaled_normal(prefix + "dense.weight"),
                                       bias=config.bias, dtype=config.dtype)
        if config.position_embedding == "alibi":
            first = topo.tp_rank * self.heads_local
            self.register_buffer("alibi_slopes",
                                 alibi_slopes(heads)[first:first + self.heads_local], persistent=False)
        else:
            self.alibi_slopes = None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, heads_local * 3 * head_dim], full sequence
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.heads_local, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        mask = None
        if self.alibi_slopes is not None or k.shape[2] != s:
            mask = causal_bias(self.alibi_slopes, s, k.shape[2], q.dtype, q.device)
        p = self.dropout if self.training else 0.0
        # Heads differ per TP rank, so attention dropout draws from the tensor-parallel stream.
        with self.rng.fork() if (self.rng is not None and p > 0) else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=mask is None)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)
        return self.dense(out)


class ParallelMLP(nn.Module):
    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer, prefix: str):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(h, f, topo, init.normal(prefix + "fc1.weight"),
                                        bias=config.bias, dtype=config.dtype)
        self.fc2 = RowParallelLinear(f, h, topo, init.scaled_normal(prefix + "fc2.weight"),
                                     bias=config.bias, dtype=config.dtype)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 layer_number: int, rng: RNGStreams | None):
        super().__init__()
        prefix = f"layers.{layer_number}."
        self.layer_number = layer_number
        self.topo, self.rng, self.dropout = topo, rng, config.hidden_dropout
        self.input_norm = LayerNorm(config, topo)
        self.attention = ParallelAttention(config, topo, init, prefix + "attention.", rng)
        self.post_attention_norm = LayerNorm(config, topo)
        self.mlp = ParallelMLP(config, topo, init, prefix + "mlp.")

    def residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return x
        # Sequence-sharded activations differ per TP rank; replicated ones must drop alike.
        with self.rng.fork() if (self.rng is not None and self.topo.sequence_parallel) else contextlib.nullcontext():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.input_norm(x), cache, self.layer_number))
        return x + self.residual_dropout(self.mlp(self.post_attention_norm(x)))
