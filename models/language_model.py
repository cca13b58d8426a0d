"""A decoder-only language model (or one pipeline chunk of it) from the shared blocks.

    tokens -> Embedding -> TransformerLayer x L -> final norm -> vocab-parallel head -> loss

A pipeline chunk builds only its part: the embedding when `pre_process`, the global layers
`layer_range`, the norm, head and loss when `post_process` (with the multi-token prediction
depths, models/multi_token_prediction.py, and, on a last stage without the embedding, a copy of
it kept equal to the first stage's as a tied embedding is). Parameter names carry global layer
numbers (`layers.7.mlp.fc1.weight`), so chunks of any split share one naming.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.context_split import Documents, sequence_positions
from megazoo.parallel.param_spec import set_spec
from megazoo.parallel.mappings import gather_last_dim, scatter_to_sequence
from megazoo.parallel.random import RNGStreams, checkpoint
from megazoo.parallel.fused_cross_entropy import lm_head_cross_entropy
from megazoo.parallel.tensor_parallel import VocabParallelEmbedding, parallel_lm_logits
from megazoo.parallel.topology import ParallelTopology

from .blocks import KVCache, TransformerLayer
from .config import TransformerConfig
from .init import Initializer
from .multi_token_prediction import MultiTokenPrediction
from .norms import build_norm
from .per_layer_inputs import PerLayerInputs
from .recompute import layer_units

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
MTP_EMBEDDINGS = "mtp_embedding.word_embeddings.weight"  # the last stage's copy (pp > 1)


class Embedding(nn.Module):
    """Word (+ learned position) embeddings -> [s, b, h], sequence-scattered under SP."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 rng: RNGStreams | None):
        super().__init__()
        self.topo, self.rng, self.dropout = topo, rng, config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.padded_vocab_size(topo.tp), config.hidden_size, topo,
            init.normal(WORD_EMBEDDINGS), dtype=config.dtype)
        # held by the last stage too when tied to the head or read by multi-token prediction
        set_spec(self.word_embeddings.weight,
                 tied_embedding=config.tie_word_embeddings or config.mtp_num_layers > 0)
        self.position_embeddings = None
        if config.position_embedding == "learned":
            weight = torch.empty(config.max_position_embeddings, config.hidden_size)
            init.normal("embedding.position_embeddings.weight")(weight)
            self.position_embeddings = nn.Embedding.from_pretrained(
                weight.to(device=topo.device, dtype=config.dtype), freeze=False)
        self.norm = build_norm(config, topo, in_sequence_region=False) if config.embedding_layernorm else None
        # Gemma: the word embeddings times sqrt(hidden_size), rounded to the weights' dtype
        self.scale = config.hidden_size ** 0.5 if config.embedding_scale else None

    def forward(self, ids: torch.Tensor, position_offset: int = 0,
                documents: Documents | None = None) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if self.position_embeddings is not None:
            positions = documents.positions if documents is not None and documents.positions is not None \
                else sequence_positions(ids.shape[1], self.topo, position_offset, ids.device)
            x = x + self.position_embeddings(positions)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.norm is not None:
            x = self.norm(x)
        if self.topo.sequence_parallel:
            x = scatter_to_sequence(x, self.topo.tp_group)
        if self.training and self.dropout > 0:
            forked = self.rng is not None and self.topo.sequence_parallel
            with self.rng.fork() if forked else contextlib.nullcontext():
                x = F.dropout(x, self.dropout, training=True)
        return x


def _family_classes(cls: type) -> list[type]:
    """Every subclass of `cls`, depth first (the family classes; for an error message)."""
    return [c for sub in cls.__subclasses__() for c in (sub, *_family_classes(sub))]


class TransformerLanguageModel(nn.Module):
    # a family's class names its family (models/registry.py keys the registry by it) and builds
    # that family's configs only; the plain language model (None) builds a config of no family
    family: str | None = None

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, *,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, rng: RNGStreams | None = None):
        super().__init__()
        if self.family is not None and config.family != self.family:
            builder = next((c.__name__ for c in _family_classes(TransformerLanguageModel)
                            if c.family == config.family), "models/registry.py's build_model")
            raise ValueError(f"{type(self).__name__} needs a {self.family!r} config; this one is "
                             f"family {config.family!r} ({builder} builds it)")
        config.check_layout(topo.config)  # the one layout rule set, once per model chunk
        self.config, self.topo, self.rng = config, topo, rng
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = layer_range or (0, config.num_layers)
        init = Initializer(config)
        self.embedding = Embedding(config, topo, init, rng) if pre_process else None
        self.per_layer_inputs = PerLayerInputs(config, topo, init) \
            if pre_process and config.per_layer_input_size else None
        # the model: embedding, one layer per LayerSpec (models/spec.py), final norm and head
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, topo, init, i, rng, config.layer_spec(i))
            for i in range(*self.layer_range)})
        self.final_norm = self.head_weight = self.mtp = self.mtp_embedding = None
        if post_process and config.mtp_num_layers:
            self.mtp = MultiTokenPrediction(config, topo, init, rng)
            if not pre_process:
                self.mtp_embedding = Embedding(config, topo, init, rng)
        if post_process:
            self.final_norm = build_norm(config, topo)
            if not (config.tie_word_embeddings and (pre_process or self.mtp_embedding is not None)):
                # Untied head, or the last stage's copy of a tied embedding (kept equal to the
                # first stage's by summing their gradients over the embedding group).
                head = VocabParallelEmbedding(config.vocab_size, config.padded_vocab_size(topo.tp),
                                              config.hidden_size, topo,
                                              init.normal(self.canonical_name("head_weight")),
                                              dtype=config.dtype)
                self.head_weight = head.weight
                set_spec(self.head_weight, tied_embedding=config.tie_word_embeddings)

    def canonical_name(self, name: str) -> str:
        """The full-model tensor a parameter holds (a tied head copy holds the embedding)."""
        if name == "head_weight" and self.config.tie_word_embeddings or name == MTP_EMBEDDINGS:
            return WORD_EMBEDDINGS
        return name

    def word_embedding(self) -> Embedding:
        """The embedding this chunk holds (the first stage's, or the last stage's copy)."""
        return self.embedding if self.embedding is not None else self.mtp_embedding

    def output_weight(self) -> torch.Tensor:
        return self.head_weight if self.head_weight is not None else \
            self.word_embedding().word_embeddings.weight

    def transformer_layers(self) -> list[TransformerLayer]:
        """This chunk's transformer layers: the main ones, then the prediction depths'."""
        return list(self.layers.values()) + ([d.layer for d in self.mtp.depths] if self.mtp else [])

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                cache: KVCache | None = None, documents: Documents | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [b, s] (first chunk) or hidden states [s, b, h] (later chunks).

        Returns hidden states unless this chunk is the last; then per-token loss [b, s] when
        `labels` are given, else this rank's vocabulary shard of the logits [b, s, v/tp].
        With a `cache` (inference), x continues the cached positions and the cache advances.
        `documents` (packed samples): attention stays within each document, positions restart.
        `loss_mask` [b, s] (the positions the caller counts) only masks the multi-token
        prediction loss, which rides along the returned per-token loss into backward.
        """
        if cache is not None and self.topo.cp > 1:
            raise ValueError("KV-cache decoding is not supported with --context-parallel-size > 1; "
                             "generate with the checkpoint loaded at context-parallel size 1")
        if cache is not None and documents is not None:
            raise ValueError("packed documents are for training; decode one sequence per sample")
        offset = cache.offset if cache is not None else 0
        h = self.embedding(x, offset, documents) if self.pre_process else x
        per_layer = self.per_layer_inputs(x, h) if self.per_layer_inputs is not None else None
        layers = list(self.layers.values())
        recompute = self.training and torch.is_grad_enabled() and cache is None
        shared = {} if self.config.kv_shared_layers else None  # (KV sharing; no recompute)
        for start, end, checkpointed in layer_units(self.config, len(layers)):
            if checkpointed and recompute:
                h = checkpoint(_run_layers(layers[start:end], documents), self.rng, h)
            else:
                for layer in layers[start:end]:
                    mine = None if per_layer is None else per_layer[:, :, layer.layer_number]
                    h = layer(h, cache, documents, shared, mine)
        if cache is not None and self.post_process:
            cache.offset += h.shape[0] * (self.topo.tp if self.topo.sequence_parallel else 1)
        if not self.post_process:
            return h
        h = self.final_norm(h)
        softcap = self.config.final_logit_softcapping
        if labels is not None:  # the head and the loss fused: the logits are never materialised
            loss = lm_head_cross_entropy(h, self.output_weight(), labels.t(), self.topo,
                                         self.config.vocab_size, softcap).t()
            if self.mtp is None:
                return loss
            if documents is not None:
                raise ValueError("--mtp-num-layers with packed documents is not modelled (the "
                                 "shifted targets would cross documents); drop one")
            return self.mtp.attach(loss, h, labels, self.word_embedding(), self.output_weight(),
                                   loss_mask)
        logits = parallel_lm_logits(h, self.output_weight(), self.topo, self.config.vocab_size)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.transpose(0, 1)  # [b, s, v/tp]


def _run_layers(layers: list[nn.Module], documents: Documents | None = None):
    """One checkpointed unit: consecutive layers run as a single function of their input."""
    def run(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = layer(h, None, documents)
        return h
    return run


def gather_logits(local_logits: torch.Tensor, topo: ParallelTopology, vocab_size: int) -> torch.Tensor:
    """Full, unpadded logits from each rank's vocabulary shard (for tools and tests)."""
    return gather_last_dim(local_logits, topo.tp_group)[..., :vocab_size]
