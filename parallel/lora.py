"""LoRA (Hu et al. 2021) on the tensor-parallel linears: y = W x + (alpha / r) B A dropout(x).

An adapter hangs on a `ColumnParallelLinear` or `RowParallelLinear` (its `lora` attribute), sharded
with its base layer:

- column-parallel base (output dim split): A [r, in] replicated, B [out/tp, r] split on its output
  like the base weight. x A^T is the same on every TP rank; `copy_to_tp` on it sums the partial
  gradients coming back from each rank's B shard (under sequence parallelism the gather of the
  sequence chunks does that, and A's gradient is summed over TP like a norm weight's).
- row-parallel base (input dim split): A [r, in/tp] split on its input, B [out, r] replicated;
  the partial x A^T is summed over TP (reduce-scattered along the sequence under sequence
  parallelism), then B applied.

A fused base (query/key/value, gate/up) carries one adapter per projection (`parts`: PEFT's
q_proj, k_proj, v_proj, each its own A and B, as PEFT keeps them on the separate HF layers); their
outputs are interleaved into the fused layout, `groups` blocks of [part 0 | part 1 | ...] (one
block per key/value group for QKV, one block for [gate; up]). Parts not targeted add nothing.

Every full starting tensor is given (`start`), so any TP size starts from the same adapters; the
adapter keeps them (`start_full`) for a checkpoint that holds no adapters (an imported base).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence
from .random import RNGStreams
from .tensor_parallel import _replicated_parameter, _sharded_parameter, sequence_parallel_param
from .topology import ParallelTopology


def lora_scale(rank: int, alpha: float, rslora: bool = False) -> float:
    """PEFT's scaling: alpha / r (alpha / sqrt(r) with rank-stabilised LoRA)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def kaiming_uniform(name: str, seed: int) -> Callable[[torch.Tensor], None]:
    """PEFT's default A initialisation (kaiming-uniform, a = sqrt(5)), seeded by the name."""
    def fill(t: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(t.shape[1])  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), ..)
        t.uniform_(-bound, bound, generator=gen)
    return fill


class LoRAAdapter(nn.Module):
    """The low-rank update of one tensor-parallel linear (see the module docstring).

    parts: [(name, full output rows of that projection)] in the fused layout's block order;
    targeted: the part names that get an adapter; start: part -> (A full [r, in], B full [out, r]).
    """

    def __init__(self, *, row_parallel: bool, in_features: int, parts: list[tuple[str, int]],
                 groups: int, targeted: set[str], rank: int, alpha: float, dropout: float,
                 topo: ParallelTopology, rng: RNGStreams | None,
                 start: dict[str, tuple[torch.Tensor, torch.Tensor]], rslora: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if row_parallel and len(parts) != 1:
            raise ValueError("a row-parallel base has one projection")
        self.row_parallel, self.topo, self.rng = row_parallel, topo, rng
        self.scale, self.dropout = lora_scale(rank, alpha, rslora), dropout
        self.parts = [(n, rows) for n, rows in parts]
        self.groups_local = max(groups // topo.tp, 1)
        self.targeted = [n for n, _ in parts if n in targeted]
        self.enabled = True  # False: the base layer alone (DPO's reference, `adapters_disabled`)
        self.start_full: dict[str, torch.Tensor] = {}  # parameter name -> full starting tensor
        for name, rows in self.parts:
            if name not in targeted:
                continue
            a_full, b_full = start[name]
            if tuple(a_full.shape) != (rank, in_features) or tuple(b_full.shape) != (rows, rank):
                raise ValueError(f"LoRA {name}: A {tuple(a_full.shape)} / B {tuple(b_full.shape)} "
                                 f"do not fit rank {rank} and the layer ({rows} x {in_features})")
            if row_parallel:
                a = _sharded_parameter((rank, in_features), 1, topo, lambda t: t.copy_(a_full), dtype)
                b = _replicated_parameter((rows, rank), topo, dtype, lambda t: t.copy_(b_full))
            else:
                a = _replicated_parameter((rank, in_features), topo, dtype, lambda t: t.copy_(a_full))
                b = _sharded_parameter((rows, rank), 0, topo, lambda t: t.copy_(b_full), dtype)
            self.register_parameter(f"A_{name}", a)
            self.register_parameter(f"B_{name}", b)
            self.start_full[f"A_{name}"], self.start_full[f"B_{name}"] = a_full, b_full

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        # x differs over TP (input-sharded, or sequence-sharded): the per-rank stream;
        # x replicated over TP: the default generator, the same on every TP rank
        local = self.row_parallel or (self.topo.sequence_parallel and self.topo.tp > 1)
        if local and self.rng is not None:
            with self.rng.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update to add to the base layer's output (this rank's part of it)."""
        x = self._dropout(x)
        topo, group = self.topo, self.topo.tp_group
        sp = topo.sequence_parallel and topo.tp > 1
        if self.row_parallel:
            name = self.targeted[0]
            h = F.linear(x, getattr(self, f"A_{name}"))
            h = reduce_scatter_to_sequence(h, group) if sp else reduce_from_tp(h, group)
            return F.linear(h, sequence_parallel_param(getattr(self, f"B_{name}"), topo)) * self.scale
        outs = {}
        for name in self.targeted:
            h = F.linear(x, sequence_parallel_param(getattr(self, f"A_{name}"), topo))
            h = gather_from_sequence(h, group) if sp else copy_to_tp(h, group)
            outs[name] = F.linear(h, getattr(self, f"B_{name}"))
        if len(self.parts) == 1:
            return outs[self.parts[0][0]] * self.scale
        lead = next(iter(outs.values())).shape[:-1]
        blocks = []
        for name, rows in self.parts:
            local = rows // topo.tp // self.groups_local  # one block's rows of this part
            y = outs.get(name)
            if y is None:
                y = x.new_zeros(*lead, self.groups_local * local)
            blocks.append(y.reshape(*lead, self.groups_local, local))
        return torch.cat(blocks, -1).reshape(*lead, -1) * self.scale


@contextlib.contextmanager
def adapters_disabled(modules):
    """The base model: every adapter in `modules` adds nothing inside the block."""
    found = [a for m in modules for _, a in adapters(m)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def attach(layer: nn.Module, adapter: LoRAAdapter) -> None:
    """Hang `adapter` on a tensor-parallel linear (it adds the update in its forward)."""
    layer.lora = adapter


def adapters(module: nn.Module):
    """(qualified name, adapter) of every LoRA adapter in a module."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, LoRAAdapter)]


def freeze_all_but_adapters(module: nn.Module) -> None:
    """The base stays out of gradients and optimizer state: only adapter parameters train."""
    ids = {id(p) for _, a in adapters(module) for p in a.parameters()}
    for p in module.parameters():
        p.requires_grad_(id(p) in ids)


def starting_weights(chunks, canonical=lambda c, n: n) -> dict[str, torch.Tensor]:
    """Full starting tensors of every adapter parameter, by parameter name (canonical(c, name))."""
    out = {}
    for c, chunk in enumerate(chunks):
        for prefix, adapter in adapters(chunk):
            for n, t in adapter.start_full.items():
                out[canonical(c, f"{prefix}.{n}")] = t
    return out
