"""Deterministic weight initialisation: every parameter has its own generator seeded from its name.

Seeding by name (not by the order layers happen to be built in) gives the same full weights for
any tensor-parallel size, any pipeline split and any virtual-chunk placement, so a sharded model
can be compared with the unsharded one without copying weights around.
"""
from __future__ import annotations

import math
import zlib

import torch

from .config import TransformerConfig


class Initializer:
    def __init__(self, config: TransformerConfig):
        self.seed, self.std, self.num_layers = config.seed, config.init_method_std, config.num_layers

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(self, name: str):
        """N(0, std) (Megatron's init_method_normal)."""
        def fill(t: torch.Tensor) -> None:
            if not t.is_meta:  # a meta tensor (tools/dry_run.py) has no values to fill
                t.normal_(0.0, self.std, generator=self._generator(name))
        return fill

    def scaled_normal(self, name: str):
        """N(0, std / sqrt(2 L)) for the layers writing into the residual stream (GPT-2 paper)."""
        std = self.std / math.sqrt(2.0 * self.num_layers)

        def fill(t: torch.Tensor) -> None:
            if not t.is_meta:
                t.normal_(0.0, std, generator=self._generator(name))
        return fill
