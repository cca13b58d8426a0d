"""Rotary position embeddings (Su et al. 2021) with Hugging Face's conventions.

Frequencies follow `transformers.modeling_rope_utils` for every `rope_type` the Llama-shaped
families take: default, proportional (Gemma 4: a leading share of the frequencies, the rest 0), linear
(position interpolation), llama3, dynamic (NTK-aware, the base
grown with the sequence), yarn (Peng et al. 2023: interpolated and extrapolated frequencies
blended over a ramp, cos/sin multiplied by the attention factor) and longrope (per-frequency
factors, the long set past the original length, with its attention factor). Rotation uses
`rotate_half` on [first half | second half] of each head, as HF Llama does, so HF q/k
projection weights load without a permutation.

dynamic and longrope depend on the sequence's length (its largest position + 1). transformers
keeps the frequencies of the longest length seen until a sequence within the original length
resets them; megazoo computes them from the current length, which is the same for a fresh model,
for training at one sequence length and for generation (lengths only grow).

A `partial_rotary_factor` in a default-type scaling is recorded only (written back at export):
transformers' Llama-shaped families read rope_theta alone there and rotate the whole head.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import TransformerConfig


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def _base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _original_length(scaling: dict, max_position_embeddings: int) -> int:
    return scaling.get("original_max_position_embeddings") or max_position_embeddings


def _yarn(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    """YaRN's blend: interpolated (positions / factor) below the ramp, extrapolated above."""
    old_len = _original_length(scaling, max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / old_len
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated


def attention_factor(scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor yarn and longrope multiply cos and sin by (so scores by its square); 1 else."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = _original_length(scaling, max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / old_len
    if kind == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the frequencies rotate (with
        # exponents over the whole head_dim), the rest are 0 (those channels stay put)
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float()
                                    / head_dim))
        inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - angles)])
        return inv_freq / scaling.get("factor", 1.0)
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(_mscale(factor, m) / _mscale(factor, m_all)) if m and m_all else _mscale(factor)


def _mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 m ln(scale) + 1 (1 without interpolation)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def latent_softmax_scale(scaling: dict | None, max_position_embeddings: int) -> float:
    """What DeepSeek's multi-latent attention multiplies its softmax scale by under a RoPE
    scaling: mscale(factor, mscale_all_dim)^2 when the scaling sets `mscale_all_dim` (the YaRN
    correction over every q/k channel, not only the rotated ones: transformers'
    `yarn_apply_mscale` in modeling_deepseek_v3, for any rope_type but default); 1 else."""
    if rope_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    old_len = _original_length(scaling, max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / old_len
    return _mscale(factor, scaling["mscale_all_dim"]) ** 2


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                        max_position_embeddings: int | None = None,
                        seq_len: int | None = None) -> torch.Tensor:
    """inv_freq [head_dim / 2] in fp32, computed exactly as transformers does; `seq_len` (the
    sequence's largest position + 1) matters to dynamic and longrope only."""
    kind = rope_type(scaling)
    if kind == "default":
        return _base_frequencies(head_dim, theta)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    if kind == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the frequencies rotate (with
        # exponents over the whole head_dim), the rest are 0 (those channels stay put)
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float()
                                    / head_dim))
        inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - angles)])
        return inv_freq / scaling.get("factor", 1.0)
    if kind == "longrope":
        old_len = _original_length(scaling, max_position_embeddings)
        ext = scaling["long_factor"] if seq_len and seq_len > old_len else scaling["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factor = scaling["factor"]
    if kind == "dynamic":
        length = max(seq_len or 0, max_position_embeddings)
        grown = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        return _base_frequencies(head_dim, grown)
    inv_freq = _base_frequencies(head_dim, theta)
    if kind == "linear":  # position interpolation: positions / factor
        return inv_freq / factor
    if kind == "llama3":
        # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = _original_length(scaling, max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, llama)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys [b, heads, s, head_dim] by their absolute positions; with the
    config's rope_theta and rope_scaling, or a layer's own (`theta`, `scaling`, `head_dim`: its
    layer spec)."""

    def __init__(self, config: TransformerConfig, device=None, *, theta: float | None = None,
                 scaling: dict | None = None, head_dim: int | None = None):
        super().__init__()
        if theta is None:
            theta, scaling = config.rope_theta, config.rope_scaling
        self.head_dim, self.theta = head_dim or config.head_dim, theta
        self.scaling, self.max_positions = scaling, config.max_position_embeddings
        self.by_length = rope_type(scaling) in ("dynamic", "longrope")
        self.factor = attention_factor(scaling, config.max_position_embeddings)
        inv_freq = inverse_frequencies(self.head_dim, theta, scaling,
                                       config.max_position_embeddings)
        # Not persistent: recomputed from the config, never stored in checkpoints.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def frequencies(self, seq_len: int | None) -> torch.Tensor:
        if not self.by_length or seq_len is None:
            return self.inv_freq
        return inverse_frequencies(self.head_dim, self.theta, self.scaling, self.max_positions,
                                   seq_len).to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype, seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.frequencies(seq_len)
        freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, head_dim] or [b, s, head_dim], fp32 like HF
        if emb.dim() == 3:
            emb = emb[:, None]  # per-sample positions: broadcast over heads
        return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                seq_len: int | None = None):
        """`positions`: the absolute position of each of the s tokens (a context-parallel rank
        holds two separate chunks of the sequence), [s], or [b, s] per sample (positions
        restarting in each packed document); `seq_len`: the whole sequence's length (default: the
        largest position + 1)."""
        if seq_len is None and self.by_length:
            seq_len = int(positions.max()) + 1
        cos, sin = self.cos_sin(positions, q.dtype, seq_len)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
