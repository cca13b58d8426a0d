"""Parameter and FLOP counts of a model config, shared by the trainer's metrics, the planner and
the dry run.

`ModelCounts` is mixed into `models.config.TransformerConfig` (callers write
`config.num_parameters()`): it holds no fields of its own and reads the config's sizes,
`head_dim`, `is_moe_layer` and `padded_vocab_size`.

A hybrid stack (`token_mixers` naming Gated DeltaNet, Mamba-2, gated attention or mixer-less
layers) is counted layer kind by layer kind by models/hybrid_counts.py: the methods below hand it
over (`_hybrid`), so the trainer's metrics and the planner count those layers as they are.
"""
from __future__ import annotations

from . import hybrid_counts


class ModelCounts:
    """Counts of the model a `TransformerConfig` describes (weights per rank, FLOPs per token)."""

    def _hybrid(self):
        """The layer-kind description of a hybrid stack (models/hybrid_counts.py), else None."""
        return hybrid_counts.describe(self) if hybrid_counts.is_hybrid(self) else None

    def _mlp_matrices(self, width: int) -> int:
        """Weights of one MLP of this width (fc1, SwiGLU's doubled, and fc2), biases aside."""
        return (3 if self.gated_mlp else 2) * width * self.hidden_size

    def mlp_parameters(self, layer: int = 0, tp: int = 1, ep: int = 1, active: bool = False) -> float:
        """Parameters of layer `layer`'s MLP held by one (TP, EP) rank: the dense MLP sharded over
        TP; or the router, this rank's experts (all `num_experts / ep`, or the `topk` a token
        uses when `active`) whole, and a TP-sharded shared expert with its gate."""
        h, bias = self.hidden_size, 1 if self.bias else 0
        fc1 = 2 if self.gated_mlp else 1
        if not self.is_moe_layer(layer):
            f = self.layer_ffn_hidden_size(layer)
            return (self._mlp_matrices(f) + bias * fc1 * f) / tp + bias * h
        out = self.num_experts * (h + (1 if self.moe_router_bias else 0)) \
            + self.expert_parameters(layer, ep, active)
        out += (h if self.moe_router_input_norm else 0) \
            + (self.num_experts if self.moe_per_expert_scale else 0)
        if self.moe_with_dense_mlp:  # the dense MLP beside the experts and their three norms
            f = self.layer_ffn_hidden_size(layer)
            out += (self._mlp_matrices(f) + bias * fc1 * f) / tp + bias * h \
                + 3 * self.norm_parameters()
        if self.moe_shared_expert_intermediate_size:
            s = self.moe_shared_expert_intermediate_size
            out += (self._mlp_matrices(s) + bias * fc1 * s) / tp + bias * h
            out += h if self.moe_shared_expert_gate else 0
        return out

    def expert_parameters(self, layer: int = 0, ep: int = 1, active: bool = False) -> float:
        """Parameters of layer `layer`'s routed experts one EP rank holds (`num_experts / ep`, or
        the `topk` a token uses when `active`); 0 for a dense layer. ZeRO shards these over the
        expert-data-parallel group, the rest of the layer over data parallelism."""
        shape = self._hybrid()
        if shape is not None and layer < shape.num_layers:
            return hybrid_counts.layer_parameters(shape, layer, 1, ep, active)[1]
        if not self.is_moe_layer(layer):
            return 0.0
        h, f, bias = self.hidden_size, self.moe_ffn_hidden_size, 1 if self.bias else 0
        fc1 = 2 if self.gated_mlp else 1
        experts = self.moe_router_topk if active else self.num_experts / ep
        return experts * (self._mlp_matrices(f) + bias * (fc1 * f + h))

    def layer_parameters(self, tp: int = 1, layer: int = 0, ep: int = 1, active: bool = False) -> float:
        """Parameters of transformer layer `layer` held by one TP (and EP) rank (replicated norms
        and biases whole; key/value heads replicated when tp exceeds their number)."""
        shape = self._hybrid()
        if shape is not None and layer < shape.num_layers:
            return sum(hybrid_counts.layer_parameters(shape, layer, tp, ep, active))
        shape = self._hybrid()
        if shape is not None and layer < shape.num_layers:
            return sum(hybrid_counts.layer_parameters(shape, layer, tp, ep, active))
        h, (d, groups, kv_rows) = self.hidden_size, self.layer_attention_shape(layer)
        attn = self.num_attention_heads * d  # = h unless kv_channels decouples the head size
        qkv = (self.num_attention_heads + kv_rows * max(groups, tp)) * d
        bias = 1 if self.bias else 0
        qkv_bias = 1 if (self.bias or self.add_qkv_bias) else 0
        qk_norms = (2 if kv_rows else 1) * d if self.qk_layernorm else 0  # (a key norm if keys)
        attention = (qkv * h + attn * h + qkv_bias * qkv) / tp + bias * h + qk_norms
        if self.kv_lora_rank:
            attention = self.latent_attention_parameters(tp)
        attention += self.num_attention_heads / tp if self.attention_sinks else 0
        norms = (4 if self.post_norms else 2) * self.norm_parameters()
        norms += 1 if self.layer_scalar else 0
        if self.per_layer_input_size and layer < self.num_layers:  # its gate, projection, norm
            norms += 2 * h * self.per_layer_input_size + self.norm_parameters()
        return attention + self.mlp_parameters(layer, tp, ep, active) + norms

    def layer_attention_shape(self, layer: int) -> tuple[int, int, int]:
        """(head size, key/value heads, projected rows per key/value head: 2, or 1 where the
        values are the key projection's output) of layer `layer`'s attention; Gemma 4's full
        layers may have their own of each."""
        full = self.attention_window(layer) is None
        groups = self.global_num_query_groups if full and self.global_num_query_groups \
            else self.num_query_groups
        rows = 0 if self.kv_source(layer) is not None else 1 if full and self.attention_k_eq_v \
            else 2  # 0: keys and values shared from an earlier layer
        return self.layer_head_dim(layer), groups, rows

    def layer_ffn_hidden_size(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width: ffn_hidden_size, or twice it on the KV-sharing layers
        with kv_shared_double_mlp (Gemma 4's use_double_wide_mlp)."""
        wide = self.kv_shared_double_mlp and self.kv_source(layer) is not None
        return self.ffn_hidden_size * (2 if wide else 1)

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head size: head_dim, or global_kv_channels on full-attention layers."""
        if self.global_kv_channels is not None and self.attention_window(layer) is None:
            return self.global_kv_channels
        return self.head_dim

    def latent_attention_parameters(self, tp: int = 1) -> float:
        """Multi-latent attention (models/mla.py) on one TP rank: the down-projections and latent
        norms whole, the up-projections and the output split by heads."""
        h, heads, rq, rkv = self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = rq * (h + 1) + rq * heads * qk / tp if rq else h * heads * qk / tp
        kv = (rkv + self.qk_rope_head_dim) * h + rkv + rkv * heads * (self.qk_nope_head_dim + self.v_head_dim) / tp
        return q + kv + heads * self.v_head_dim * h / tp

    def embedding_parameters(self, tp: int = 1, padded: bool = False) -> float:
        """Word embedding (one TP rank's share; padded as built, or the unpadded vocabulary),
        learned positions and the embedding norm."""
        words = (self.padded_vocab_size(tp) if padded else self.vocab_size) * self.hidden_size / tp
        positions = self.max_position_embeddings * self.hidden_size \
            if self.position_embedding == "learned" else 0
        per_layer = 0
        if self.per_layer_input_size:  # models/per_layer_inputs.py, TP-replicated
            width = self.num_layers * self.per_layer_input_size
            vocab = self.per_layer_input_vocab_size or self.vocab_size
            per_layer = width * (vocab + self.hidden_size) \
                + self.norm_kind.parameters(self.per_layer_input_size)
        return words + positions + per_layer + \
            (self.norm_parameters() if self.embedding_layernorm else 0)

    def norm_parameters(self) -> int:
        """Parameters of one norm (LayerNorm has a bias, RMSNorm not)."""
        return self.norm_kind.parameters(self.hidden_size)

    def mtp_parameters(self, tp: int = 1, ep: int = 1) -> float:
        """Parameters of the multi-token prediction depths one (TP, EP) rank of the last stage
        holds beyond the shared embedding and head: per depth two input norms, the [2h -> h]
        projection (TP-split), one transformer layer (numbered after the main ones) and its
        output norm. Not in `num_parameters` (DeepSeek-V3's 671B leaves them out too)."""
        proj = 2 * self.hidden_size * self.hidden_size / tp
        return sum(3 * self.norm_parameters() + proj + self.layer_parameters(tp, self.num_layers + k, ep)
                   for k in range(self.mtp_num_layers))

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the unpadded model (tied embeddings counted once; the multi-token
        prediction depths apart: `mtp_parameters`); `active`: those one token uses (MoE: the
        router's top-k experts of each layer, not all of them)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        layers = sum(self.layer_parameters(layer=i, active=active) for i in range(self.num_layers))
        return int(self.embedding_parameters() + layers + self.norm_parameters() + head)

    def forward_flops_per_token(self, seq_length: int) -> tuple[float, float, float]:
        """(dense layer matmuls, attention scores and values, logits): forward FLOPs per token over
        all layers, 2 per multiply-add (Narayanan et al. 2021's count, with GQA and SwiGLU; MoE
        layers count the router and the top-k experts a token visits)."""
        shape = self._hybrid()
        if shape is not None:
            return hybrid_counts.forward_flops_per_token(shape, seq_length)
        h, heads = self.hidden_size, self.num_attention_heads
        attention = scores = 0  # per layer: its head size and key/value heads (Gemma 4's full)
        for i in range(self.num_layers):
            d, groups, kv_rows = self.layer_attention_shape(i)
            attention += h * (heads + kv_rows * groups) * d + heads * d * h
            scores += 4 * seq_length * heads * d
        mlp = 0
        for i in range(self.num_layers):
            if not self.is_moe_layer(i) or self.moe_with_dense_mlp:
                mlp += self._mlp_matrices(self.layer_ffn_hidden_size(i))
            if not self.is_moe_layer(i):
                continue
            if self.moe_shared_expert_intermediate_size:
                mlp += self._mlp_matrices(self.moe_shared_expert_intermediate_size) + \
                    (h if self.moe_shared_expert_gate else 0)
        if self.kv_lora_rank:  # MLA: its projections; scores over nope + rope, values over v
            attention = self.num_layers * self.latent_attention_parameters()
            scores = self.num_layers * 2 * seq_length * self.num_attention_heads * (
                self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        dense = 2 * (attention + mlp) + self.routed_flops_per_token()
        return dense, scores, 2 * h * self.vocab_size

    def routed_flops_per_token(self) -> int:
        """Forward FLOPs per token of the routers and the top-k experts a token visits, over all
        layers: the part of `forward_flops_per_token` that runs whole on every TP rank."""
        per_layer = self.num_experts * self.hidden_size + self.moe_router_topk * \
            self._mlp_matrices(self.moe_ffn_hidden_size) if self.num_experts else 0
        return 2 * per_layer * sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def model_flops_per_token(self, seq_length: int) -> float:
        """Forward + backward (3x forward) FLOPs per token without recompute: the MFU convention."""
        return 3.0 * sum(self.forward_flops_per_token(seq_length))
