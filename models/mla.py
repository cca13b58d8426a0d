"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

    q   = q_up(norm(q_down x))              (or q_proj x without --q-lora-rank)  [heads, nope + rope]
    kv  = kv_down x = [latent (kv_lora_rank) | k_pe (qk_rope_head_dim)]
    k, v = kv_up(norm(latent))                                                   [heads, nope], [heads, v]
    keys = [k | rope(k_pe) shared by every head], queries = [q_nope | rope(q_pe)]
    out = dense(softmax(q k^T m / sqrt(nope + rope) + causal) v)

Tensor parallelism splits the heads: `q_up` / `q_proj` and `kv_up` are column-parallel, `dense`
row-parallel; the down-projections and the latent norms are replicated. Under sequence
parallelism the down-projections run on each rank's sequence chunk (their weights' gradients
summed over TP), the up-projections all-gather the latents as any column-parallel linear does,
and the shared k_pe is gathered with a reduce-scatter backward; without SP it is the same tensor
on every rank, each using it for its own heads, so its gradient is summed over TP.

Context parallelism: each rank holds its two chunks of the sequence (parallel/context_parallel.py),
RoPE rotates them at their own positions (`sequence_positions`), and the core runs as ring or
all-to-all attention (`context_attention`) with the keys' nope + rope head dim, the values' own
head dim and MLA's softmax scale below; k_pe is expanded to every head before it travels.

RoPE rotates the decoupled `qk_rope_head_dim` channels only, in DeepSeek's interleaved pair layout
(channels 2i, 2i+1 by frequency i: transformers' `rope_interleave`, the layout of the released
weights), or HF's halves layout when `rope_interleave` is off. The latent norms use
`layernorm_epsilon`. q/k head dim differs from v's: the attention kernel takes that as it is
(`parallel/kernels/attention.py`). RoPE scaling as transformers' DeepSeek-V3: the scaled
frequencies over the rope channels, cos/sin times the type's attention factor, and the softmax
times m = mscale(factor, mscale_all_dim)^2 when YaRN sets mscale_all_dim (1 else;
models/rope.py). Not modelled, refused: the length-dependent scalings (dynamic, longrope).

QK-clip (parallel/zero/qk_clip.py): while tracking is on, each training forward folds its heads'
largest logit, q = [q_nope, q_pe] against k = [k_nope, k_pe] at MLA's softmax scale, into
`max_logits`; the step then scales, per clipped head, q_C (its q nope rows) and k_C (its kv_up
k nope rows) by gamma^alpha and gamma^(1 - alpha), q_R (its q rope rows) by gamma, and leaves the
shared k_R (kv_down's k_pe rows) and the values alone, as the Kimi K2 report (sec. 2.1) does.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.context_parallel import check_attention, context_attention
from megazoo.parallel.context_split import sequence_positions
from megazoo.parallel.kernels.attention import attention
from megazoo.parallel.kernels.max_logit import head_max_logits
from megazoo.parallel.mappings import copy_to_tp, gather_from_sequence
from megazoo.parallel.random import RNGStreams, checkpoint
from megazoo.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, sequence_parallel_param
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .norms import RMSNorm
from .rope import attention_factor, inverse_frequencies, latent_softmax_scale, rope_type, rotate_half

# RoPE scalings whose frequencies depend on the sequence's length: not modelled for MLA
_LENGTH_DEPENDENT = ("dynamic", "longrope")


class LatentRotary(nn.Module):
    """RoPE over the decoupled channels [..., qk_rope_head_dim] of queries and the shared key,
    with the config's scaling (YaRN: its frequencies over these channels, cos and sin times its
    attention factor, as transformers' DeepSeek-V3 rotary embedding)."""

    def __init__(self, config: TransformerConfig, device=None):
        super().__init__()
        self.interleaved = config.rope_interleave
        scaling, positions = config.rope_scaling, config.max_position_embeddings
        inv_freq = inverse_frequencies(config.qk_rope_head_dim, config.rope_theta, scaling, positions)
        self.factor = attention_factor(scaling, positions)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        # [s, d/2], fp32 like HF, the factor applied before the cast as HF does
        cos, sin = (freqs.cos() * self.factor).to(x.dtype), (freqs.sin() * self.factor).to(x.dtype)
        if self.interleaved:  # pairs (2i, 2i+1) -> halves [first of each pair | second]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return x * cos + rotate_half(x) * sin


class MultiLatentAttention(nn.Module):
    """Causal multi-head latent attention; heads split over TP ranks."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str, rng: RNGStreams | None):
        super().__init__()
        check_attention(config.attention_dropout, topo.cp)
        if rope_type(config.rope_scaling) in _LENGTH_DEPENDENT:
            raise ValueError(f"rope_scaling type {rope_type(config.rope_scaling)!r} with "
                             f"multi-latent attention is not supported (its frequencies depend "
                             f"on the sequence's length); use yarn, linear or llama3")
        h, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                            config.v_head_dim)
        self.latent = config.kv_lora_rank
        self.heads_local, self.topo, self.rng = heads // topo.tp, topo, rng
        self.dropout = config.attention_dropout
        self.recompute_core = config.recompute_granularity == "selective"
        qk = self.nope + self.rope

        def replicated(name: str, rows: int) -> nn.Parameter:
            w = torch.empty(rows, h)
            init.normal(prefix + name)(w)
            return nn.Parameter(w.to(device=topo.device, dtype=config.dtype))

        def norm(size: int) -> RMSNorm:
            return RMSNorm(config, topo, in_sequence_region=True, size=size)

        self.q_down = self.q_norm = self.q_up = self.q_proj = None
        if config.q_lora_rank:
            self.q_down = replicated("q_down.weight", config.q_lora_rank)
            self.q_norm = norm(config.q_lora_rank)
            self.q_up = ColumnParallelLinear(config.q_lora_rank, heads * qk, topo,
                                             init.normal(prefix + "q_up.weight"), bias=False,
                                             dtype=config.dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * qk, topo, init.normal(prefix + "q_proj.weight"),
                                               bias=False, dtype=config.dtype)
        self.kv_down = replicated("kv_down.weight", self.latent + self.rope)
        self.kv_norm = norm(self.latent)
        self.kv_up = ColumnParallelLinear(self.latent, heads * (self.nope + self.v_dim), topo,
                                          init.normal(prefix + "kv_up.weight"), bias=False,
                                          dtype=config.dtype)
        self.dense = RowParallelLinear(heads * self.v_dim, h, topo,
                                       init.scaled_normal(prefix + "dense.weight"), bias=False,
                                       dtype=config.dtype)
        self.rotary = LatentRotary(config, topo.device)
        # YaRN with mscale_all_dim also scales the softmax (DeepSeek's correction)
        self.scale = qk ** -0.5 * latent_softmax_scale(config.rope_scaling,
                                                       config.max_position_embeddings)
        # QK-clip switches tracking on (module docstring); the latent norms precede the
        # up-projections, so unlike a q/k layernorm they keep a rescaling of those rows.
        self.track_max_logits, self.qk_layernorm = False, False
        self.max_logits: torch.Tensor | None = None

    def core_attention(self, q, k, v) -> torch.Tensor:
        """softmax(q k^T * scale + causal) v: q, k [b, heads, s, nope + rope], v [b, heads, s,
        v_head_dim]; over every context-parallel rank's part of the sequence when cp > 1."""
        if self.track_max_logits and self.training:
            seen = head_max_logits(q, k, scale=self.scale, q_offset=k.shape[2] - q.shape[2])
            self.max_logits = seen if self.max_logits is None else torch.maximum(self.max_logits,
                                                                                  seen)
        if self.topo.cp > 1:
            return context_attention(q, k, v, self.topo, None, attention, scale=self.scale)
        p = self.dropout if self.training else 0.0
        with self.rng.fork() if (self.rng is not None and p > 0) else contextlib.nullcontext():
            return attention(q, k, v, dropout_p=p, scale=self.scale, q_offset=k.shape[2] - q.shape[2])

    def forward(self, x: torch.Tensor, cache=None, layer: int = 0, documents=None) -> torch.Tensor:
        """x [s(/tp under SP), b, h] -> [s(/tp), b, h]; `cache`: models.attention.KVCache."""
        if documents is not None:  # (the flags refuse packing with MLA before a run starts)
            raise ValueError("multi-latent attention does not model packed documents "
                             "(--reset-attention-mask/--reset-position-ids, --sft-packing)")
        topo, g = self.topo, self.topo.tp_group
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_up(self.q_norm(F.linear(x, sequence_parallel_param(self.q_down, topo))))
        kv = F.linear(x, sequence_parallel_param(self.kv_down, topo))
        latent, k_pe = kv.split([self.latent, self.rope], dim=-1)
        kv = self.kv_up(self.kv_norm(latent))  # [s, b, local heads * (nope + v)], whole sequence
        # k_pe is shared by all heads: each rank's gradient covers its own heads only
        k_pe = gather_from_sequence(k_pe, g) if topo.sequence_parallel and topo.tp > 1 \
            else copy_to_tp(k_pe, g)
        s, b, _ = q.shape
        q = q.view(s, b, self.heads_local, -1).permute(1, 2, 0, 3)  # [b, heads, s, nope + rope]
        k_nope, v = kv.view(s, b, self.heads_local, -1).permute(1, 2, 0, 3).split(
            [self.nope, self.v_dim], dim=-1)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        positions = sequence_positions(s, topo, cache.offset if cache is not None else 0)
        q_pe = self.rotary(q_pe, positions)
        k_pe = self.rotary(k_pe.permute(1, 0, 2).unsqueeze(1), positions)  # [b, 1, s, rope]
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads_local, -1, -1)], dim=-1)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.rng, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.v_dim)
        return self.dense(out)

    def qk_clip_row_scales(self, gamma: torch.Tensor, alpha: float
                           ) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, multipliers [its local rows]) that scale head h's logits by gamma[h]
        (this TP rank's heads; module docstring): the query projection's rows per head are
        [nope | rope], kv_up's [k nope | v]; kv_down (the shared k_pe) is not among them."""
        gamma = gamma.float()[:, None]
        q_rows = torch.cat([(gamma ** alpha).expand(-1, self.nope),
                            gamma.expand(-1, self.rope)], dim=1).reshape(-1)
        kv_rows = torch.cat([(gamma ** (1 - alpha)).expand(-1, self.nope),
                             torch.ones_like(gamma).expand(-1, self.v_dim)], dim=1).reshape(-1)
        q = self.q_proj if self.q_proj is not None else self.q_up
        return [(q.weight, q_rows), (self.kv_up.weight, kv_rows)]
