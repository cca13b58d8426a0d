"""Per-layer inputs (Gemma 4's per-layer embeddings, hidden_size_per_layer_input = p): each layer
i also reads a vector of its own per token,

    e = E_pl[token] * sqrt(p)                        (an embedding of L * p per token)
    q = rms_norm_p((x @ P^T) * hidden^-0.5)          (x: the scaled word embeddings)
    per_layer[i] = (q[i] + e[i]) * 2^-0.5            ([s, b, L, p], layer-major as in HF)

and after its MLP adds  norm(W_proj (gelu_tanh(W_gate x) * per_layer[i]))  to the residual
stream (models/blocks.py, `LayerSpec.per_layer_input`). Every weight here is TP-replicated; under
sequence parallelism each rank computes its chunk of the sequence and the weights' gradients are
summed over TP (`sequence_parallel_param`), as a norm's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.mappings import scatter_to_sequence
from megazoo.parallel.tensor_parallel import sequence_parallel_param
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .norms import build_norm

PER_LAYER_ACTIVATION = "gelu_tanh"  # a key of spec.ACTIVATIONS (Gemma 4's hidden_activation)


class PerLayerInputs(nn.Module):
    """`embeddings` [vocab, L * p], `projection` [L * p, hidden] and `norm` (over p)."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer):
        super().__init__()
        self.topo, self.layers, self.size = topo, config.num_layers, config.per_layer_input_size
        vocab = config.per_layer_input_vocab_size or config.vocab_size
        width = self.layers * self.size

        def weight(name: str, shape: tuple[int, int]) -> nn.Parameter:
            t = torch.empty(shape)
            init.normal(f"per_layer_inputs.{name}")(t)
            return nn.Parameter(t.to(device=topo.device, dtype=config.dtype))

        self.embeddings = weight("embeddings", (vocab, width))
        self.projection = weight("projection", (width, config.hidden_size))
        self.norm = build_norm(config, topo, size=self.size)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """ids [b, s] (this rank's tokens), x [s, b, h] as the first layer reads it (this rank's
        chunk under sequence parallelism) -> [s, b, L, p], the same chunk."""
        ids = ids.t()
        if self.topo.sequence_parallel:
            ids = scatter_to_sequence(ids.contiguous(), self.topo.tp_group)
        e = F.embedding(ids, sequence_parallel_param(self.embeddings, self.topo))
        e = e * torch.tensor(self.size ** 0.5, dtype=e.dtype)
        q = F.linear(x, sequence_parallel_param(self.projection, self.topo)) * x.shape[-1] ** -0.5
        shape = (*x.shape[:2], self.layers, self.size)
        return (self.norm(q.view(shape)) + e.view(shape)) * 2 ** -0.5
