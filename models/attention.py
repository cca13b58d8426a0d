"""Tensor-parallel causal self-attention: multi-head or grouped-query, learned/ALiBi/rotary
positions, and the KV cache for incremental decoding.

Fused QKV layout, per key/value group: [its q_per_group query heads, 1 key, 1 value] x head_dim.
With one query head per group this is Megatron/BLOOM's per-head [heads, 3, head_dim] order. A
column split over TP keeps whole groups on a rank while tp <= groups; with more ranks than
groups, each group's key and value are replicated on the ranks sharing its query heads
(`GroupedLayout`), so every rank attends with the right key/value head.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from megazoo.parallel.context_parallel import check_attention, context_attention
from megazoo.parallel.context_split import Documents, sequence_positions
from megazoo.parallel.kernels.attention import attention
from megazoo.parallel.kernels.eager_attention import eager_attention
from megazoo.parallel.kernels.max_logit import head_max_logits
from megazoo.parallel.param_spec import TensorParallelSplit, set_spec
from megazoo.parallel.random import RNGStreams, checkpoint
from megazoo.parallel.tensor_parallel import ColumnParallelLinear, GroupedLayout, RowParallelLinear
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .norms import build_norm
from .rope import RotaryEmbedding
from .spec import MixerSpec


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


class KVCache:
    """Keys and values of earlier positions, per layer, for incremental decoding.

    `offset` is the number of positions already cached; the model advances it after each forward.
    Tensors are [b, kv_heads_local, positions, head_dim] (this TP rank's key/value heads only;
    keys are stored after the rotary embedding).
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.states: dict[int, object] = {}  # linear token mixers' constant-size states
        self.offset = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values with these appended (for this step's attention). With a
        sliding `window` only the last window - 1 stay cached: the next query sees those and
        itself, so the cache is bounded by the window, not the generated length."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        keep = k.shape[2] if window is None else min(window - 1, k.shape[2])
        self.keys[layer], self.values[layer] = k[:, :, k.shape[2] - keep:], v[:, :, k.shape[2] - keep:]
        return k, v


class ParallelAttention(nn.Module):
    """Causal self-attention; query heads split over TP ranks; fused QKV grouped per KV head.

    `spec` (the layer's token mixer, models/spec.py) gives the layer's window, RoPE base and
    scaling, q/k norm, sinks, softcap and softmax scale; None: the config's, for any layer."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str, rng: RNGStreams | None, spec: MixerSpec | None = None):
        super().__init__()
        h, heads, groups, d = (config.hidden_size, config.num_attention_heads,
                               config.num_query_groups, config.head_dim)
        if spec is not None and spec.head_dim is not None:
            d = spec.head_dim  # this layer's own head size (Gemma 4's full layers)
        if spec is not None and spec.kv_heads is not None:
            groups = spec.kv_heads  # this layer's own key/value heads (Gemma 4's full layers)
        # Gemma 4's full layers with attention_k_eq_v: [q heads, k] per group, values from k;
        # KV sharing: queries only, keys and values those an earlier layer attended with
        self.k_eq_v = spec is not None and spec.k_eq_v
        self.kv_source = spec.kv_source if spec is not None else None
        self.kv_sink = spec is not None and spec.kv_sink
        kv_rows = 0 if self.kv_source is not None else 1 if self.k_eq_v else 2
        self.kv_rows = kv_rows
        self.heads_local, self.head_dim = heads // topo.tp, d
        self.groups_local = max(groups // topo.tp, 1)  # 1 when KV heads are replicated
        self.q_per_group_local = self.heads_local // self.groups_local
        self.multi_head = groups == heads  # each key head serves one query head (not GQA)
        self.dropout, self.rng, self.topo = config.attention_dropout, rng, topo
        self.window_of = config.attention_window  # per global layer (sliding-window layers)
        if spec is not None:
            self.window_of = lambda _layer, window=spec.window: window
        self.softmax_scale = spec.scale if spec is not None else None
        self.softcap = spec.softcap if spec is not None else None
        self.scale_attn_weights = config.scale_attn_weights
        self.scale_by_layer = config.scale_attn_by_inverse_layer_idx
        check_attention(config.attention_dropout, topo.cp)
        if topo.cp > 1 and (self.scale_by_layer or not self.scale_attn_weights):
            raise ValueError("GPT-2's scale_attn_weights=False / scale_attn_by_inverse_layer_idx "
                             "are not supported with --context-parallel-size > 1")
        # --recompute-granularity selective: the core is recomputed in backward (models/recompute.py)
        self.recompute_core = config.recompute_granularity == "selective"
        per_group = heads // groups
        # Multi-head attention keeps plain contiguous shards (GPT and BLOOM checkpoints as before).
        layout = None if (groups == heads and kv_rows == 2) or not kv_rows \
            else GroupedLayout(groups, per_group * d, kv_rows * d)
        self.qkv = ColumnParallelLinear(h, (heads + kv_rows * groups) * d, topo, init.normal(prefix + "qkv.weight"),
                                        bias=config.bias or config.add_qkv_bias, dtype=config.dtype,
                                        layout=layout)
        self.dense = RowParallelLinear(heads * d, h, topo, init.scaled_normal(prefix + "dense.weight"),
                                       bias=config.bias, dtype=config.dtype)
        # Qwen3, Gemma 3: a norm over head_dim, one weight shared by all query (key) heads
        self.q_norm = self.k_norm = None
        qk_norm = spec.qk_norm if spec is not None else config.qk_layernorm
        self.qk_layernorm = qk_norm  # (QK-clip refuses it: the norm undoes a rescaling)
        if qk_norm:
            self.q_norm = build_norm(config, topo, in_sequence_region=False, size=d, over_tp_heads=True)
            if kv_rows:
                self.k_norm = build_norm(config, topo, in_sequence_region=False, size=d,
                                         over_tp_heads=True)
        # Gemma 4: values normalised per head (no weight), as x / rms(x)
        self.v_norm_eps = config.layernorm_epsilon if spec is not None and spec.v_norm \
            and kv_rows else None
        self.rotary = None
        # partial RoPE (rotary_fraction): the leading channels of each head turn, the rest stay
        self.rotated = round(d * config.rotary_fraction)
        if spec is not None and spec.rope_theta is not None:
            self.rotary = RotaryEmbedding(config, topo.device, theta=spec.rope_theta,
                                          scaling=spec.rope_scaling, head_dim=self.rotated)
        elif spec is None and config.position_embedding == "rope":
            self.rotary = RotaryEmbedding(config, topo.device, head_dim=self.rotated)
        # gpt-oss: a learned sink logit per head (this rank's heads), in every softmax
        self.sinks = None
        if spec is not None and spec.sinks:
            weight = torch.empty(heads)
            init.normal(prefix + "sinks")(weight)
            first = topo.tp_rank * self.heads_local
            self.sinks = nn.Parameter(weight[first:first + self.heads_local].to(
                device=topo.device, dtype=config.dtype))
            set_spec(self.sinks, tp_split=TensorParallelSplit(dim=0, full_size=heads))
        self.eager = self.sinks is not None or self.softcap is not None
        if self.eager and (topo.cp > 1 or config.attention_dropout):
            raise ValueError("attention sinks and attention-logit softcapping are computed by "
                             "eager attention: they take neither --context-parallel-size > 1 nor "
                             "--attention-dropout; drop one")
        # QK-clip (parallel/zero/qk_clip.py) switches tracking on: then each training forward
        # folds its heads' largest logit into `max_logits` [heads_local], read and reset by the
        # optimizer step. The model never communicates it.
        self.track_max_logits = False
        self.max_logits: torch.Tensor | None = None
        if config.position_embedding == "alibi":
            first = topo.tp_rank * self.heads_local
            self.register_buffer("alibi_slopes",
                                 alibi_slopes(heads)[first:first + self.heads_local], persistent=False)
        else:
            self.alibi_slopes = None

    def _scale(self, layer: int) -> float | None:
        """Softmax scale: 1/sqrt(head_dim) (None: SDPA's own), unless GPT-2's flags switch it off
        or divide it by (layer + 1) (`layer` is the global layer number)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        if self.scale_attn_weights and not self.scale_by_layer:
            return None
        scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_by_layer else scale

    def core_attention(self, q, k, v, layer: int, documents: Documents | None = None) -> torch.Tensor:
        """softmax(QK^T * scale + causal/ALiBi bias) V with attention dropout, [b, heads, s, d]
        each; over every context-parallel rank's part of the sequence when cp > 1; within each
        packed document when `documents` has ids."""
        ids = documents.ids if documents is not None else None
        window = self.window_of(layer)
        if self.track_max_logits and self.training:
            seen = head_max_logits(q, k, scale=self._scale(layer), window=window,
                                   q_offset=k.shape[2] - q.shape[2], q_document_ids=ids)
            self.max_logits = seen if self.max_logits is None else torch.maximum(self.max_logits,
                                                                                  seen)
        if self.eager:
            if ids is not None:
                raise ValueError("attention sinks and softcapping do not take packed documents "
                                 "(--reset-attention-mask); drop one")
            return eager_attention(q, k, v, scale=self._scale(layer), window=window,
                                   q_offset=k.shape[2] - q.shape[2], softcap=self.softcap,
                                   sinks=self.sinks)
        if self.topo.cp > 1:
            return context_attention(q, k, v, self.topo, self.alibi_slopes, attention, window, ids)
        p = self.dropout if self.training else 0.0
        # Heads differ per TP rank, so attention dropout draws from the tensor-parallel stream.
        with self.rng.fork() if (self.rng is not None and p > 0) else contextlib.nullcontext():
            # queries are the last of the keys' positions (a KV cache holds the earlier ones)
            return attention(q, k, v, alibi_slopes=self.alibi_slopes, dropout_p=p, window=window,
                             scale=self._scale(layer), q_offset=k.shape[2] - q.shape[2],
                             q_document_ids=ids)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                documents: Documents | None = None, shared: dict | None = None) -> torch.Tensor:
        """`shared` (KV sharing): the keys and values of the layers later ones reuse, by layer."""
        qkv = self.qkv(x)  # [s, b, local (q, k, v) features], full sequence even under SP
        s, b, _ = qkv.shape
        g, qg, d = self.groups_local, self.q_per_group_local, self.head_dim
        # split, not three slices: its backward is one concatenation, where slices would each
        # scatter into a zeroed full-size gradient to be summed
        k = v = None
        if not self.kv_rows:  # queries only (KV sharing)
            q = qkv.view(s, b, g, qg, d)
        elif self.k_eq_v:  # the values are the keys as projected (normed below apart)
            q, k = qkv.view(s, b, g, qg + 1, d).split([qg, 1], dim=3)
            v = k
        else:
            q, k, v = qkv.view(s, b, g, qg + 2, d).split([qg, 1, 1], dim=3)
        q = q.reshape(s, b, g * qg, d).permute(1, 2, 0, 3)  # [b, heads, s, d]
        if k is not None:
            k, v = k.squeeze(3).permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm_eps is not None:
            v32 = v.float()
            v = (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + self.v_norm_eps)).to(v.dtype)
        if self.rotary is not None:
            offset = cache.offset if cache is not None else 0
            positions = documents.positions if documents is not None and documents.positions is not None \
                else sequence_positions(s, self.topo, offset)
            # the whole sequence's length (length-dependent RoPE; a CP rank holds s of s x cp)
            keys, r = q[:, :1] if k is None else k, self.rotated
            q_r, k_r = self.rotary(q[..., :r], keys[..., :r], positions,
                                   seq_len=offset + s * self.topo.cp)
            q = torch.cat([q_r, q[..., r:]], -1) if r < q.shape[-1] else q_r
            rotated = torch.cat([k_r, keys[..., r:]], -1) if r < keys.shape[-1] else k_r
            k = rotated if k is not None else None
        if k is None:  # as the earlier layer attended with them (after its cache)
            k, v = shared[self.kv_source]
        elif cache is not None:
            k, v = cache.update(layer, k, v, self.window_of(layer))
        if self.kv_sink:
            shared[layer] = k, v
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.rng, q, k, v, layer, documents)
        else:
            out = self.core_attention(q, k, v, layer, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * d)
        return self.dense(out)

    def qk_clip_row_scales(self, gamma: torch.Tensor, alpha: float
                           ) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, multipliers [its local rows]) that scale head h's logits by gamma[h]
        (this TP rank's heads): the fused QKV weight and bias, with one query head per key head
        (MHA) its query rows by gamma^alpha and its key rows by gamma^(1 - alpha); a key shared by several query heads (grouped-query) is left
        alone and each query head takes its whole gamma, as QK-clip treats MLA's shared rotary
        key. Values are never scaled."""
        g, qg, d = self.groups_local, self.q_per_group_local, self.head_dim
        rows = torch.ones(g, qg + self.kv_rows, dtype=torch.float32, device=gamma.device)
        per_group = gamma.float().view(g, qg)
        if self.multi_head:
            rows[:, 0], rows[:, 1] = per_group[:, 0] ** alpha, per_group[:, 0] ** (1 - alpha)
        else:
            rows[:, :qg] = per_group
        rows = rows.repeat_interleave(d, dim=1).reshape(-1)
        return [(p, rows) for p in (self.qkv.weight, self.qkv.bias) if p is not None]
