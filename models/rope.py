"""Rotary position embeddings (Su et al. 2021) with Hugging Face's conventions.

Frequencies follow `transformers.modeling_rope_utils` ("default", "linear" and "llama3" types) and
rotation uses `rotate_half` on [first half | second half] of each head, as HF Llama does, so HF
q/k projection weights load without a permutation.
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


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                        max_position_embeddings: int | None = None) -> torch.Tensor:
    """inv_freq [head_dim / 2] in fp32, computed exactly as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    factor = scaling["factor"]
    if kind == "linear":  # position interpolation: positions / factor
        return inv_freq / factor
    if kind == "llama3":
        # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings", max_position_embeddings)
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
    """Rotates queries and keys [b, heads, s, head_dim] by their absolute positions."""

    def __init__(self, config: TransformerConfig, device=None):
        super().__init__()
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                       config.max_position_embeddings)
        # Not persistent: recomputed from the config, never stored in checkpoints.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, head_dim] or [b, s, head_dim], fp32 like HF
        if emb.dim() == 3:
            emb = emb[:, None]  # per-sample positions: broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """`positions`: the absolute position of each of the s tokens (a context-parallel rank
        holds two separate chunks of the sequence), [s], or [b, s] per sample (positions
        restarting in each packed document)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
