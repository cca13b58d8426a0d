"""Tensor-parallel layers (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Every sharded parameter records how it was cut (`spec_of(param).tp_split`, see
`parallel/param_spec.py`: the split dimension, its unpadded full size and, where shards are not
contiguous chunks, a `StridedLayout` or `GroupedLayout`), so checkpoints, converters and tests can
gather or re-slice it without knowing the model.

Initialisation builds the full tensor from a generator the caller seeds, then keeps this rank's
slice: the same seed gives the same full weight for every TP size.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_reduce
from .mappings import (copy_to_tp, gather_from_sequence, gather_last_dim, reduce_from_tp,
                       reduce_scatter_to_sequence)
from .grad_fusion import linear
from .param_spec import TensorParallelSplit, set_spec, spec_of
from .sequence_parallel_linear import sequence_gathered_linear
from .topology import ParallelTopology

InitFn = Callable[[torch.Tensor], None]  # fills a full (unsharded) fp32 tensor in place


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, full_size: int,
                         layout: "ShardLayout | None" = None) -> None:
    set_spec(param, tp_split=TensorParallelSplit(partition_dim, full_size, layout))


def tp_layout(param: torch.Tensor) -> "ShardLayout | None":
    split = spec_of(param).tp_split
    return split.layout if split is not None else None


class ShardLayout:
    """How a full tensor maps to TP shards along `partition_dim` when not as contiguous chunks.

    `shard(full, dim, rank, tp)` gives rank's part; `unshard(parts, dim)` rebuilds the full tensor
    from every rank's part (in rank order). Parts always have equal sizes.
    """

    def shard(self, full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
        raise NotImplementedError

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        raise NotImplementedError

    def replicated_rows(self, tp: int) -> int:
        """Trailing rows of each shard that are copies held by several ranks (0: none)."""
        return 0

    def spec(self) -> dict:
        """A JSON-able description (for checkpoint parameter tables); see `layout_from_spec`."""
        return {"kind": type(self).__name__, **vars(self)}


class StridedLayout(ShardLayout):
    """The full tensor is `stride` equal blocks (e.g. a fused [gate; up]); each block is split
    over TP and rank i holds [block_0 chunk i; block_1 chunk i; ...] (Megatron's partition_stride)."""

    def __init__(self, stride: int):
        self.stride = stride

    def shard(self, full, dim, rank, tp):
        return torch.cat([b.chunk(tp, dim)[rank] for b in full.chunk(self.stride, dim)], dim)

    def unshard(self, parts, dim):
        pieces = [p.chunk(self.stride, dim) for p in parts]
        return torch.cat([pieces[r][j] for j in range(self.stride) for r in range(len(parts))], dim)


class SegmentLayout(ShardLayout):
    """The full tensor is consecutive segments of the given `sizes` (a linear mixer's fused
    [q | k | v] or [z | x | B | C | dt] rows); each segment is split over TP and rank i holds
    [segment_0 chunk i; segment_1 chunk i; ...] (StridedLayout with unequal blocks)."""

    def __init__(self, sizes):
        self.sizes = [int(n) for n in sizes]

    def shard(self, full, dim, rank, tp):
        if any(n % tp for n in self.sizes):
            raise ValueError(f"segments {self.sizes} cannot be split over {tp} ranks")
        return torch.cat([b.chunk(tp, dim)[rank] for b in full.split(self.sizes, dim)], dim)

    def unshard(self, parts, dim):
        tp = len(parts)
        pieces = [p.split([n // tp for n in self.sizes], dim) for p in parts]
        return torch.cat([pieces[r][j] for j in range(len(self.sizes)) for r in range(tp)], dim)


class GroupedLayout(ShardLayout):
    """`groups` groups of [split rows | shared rows] (grouped-query attention: per KV head, its
    query heads, then its key and value). With tp <= groups every rank holds whole groups
    (contiguous chunks). With tp > groups each group's ranks split its `split` rows and each
    hold a copy of its `shared` rows, whose gradients `_ReplicaGradSum` sums over the copies."""

    def __init__(self, groups: int, split: int, shared: int):
        self.groups, self.split, self.shared = groups, split, shared

    def _replicas(self, tp: int) -> int:
        if tp % self.groups and self.groups % tp:
            raise ValueError(f"{self.groups} groups cannot be split over or replicated on {tp} ranks")
        return max(tp // self.groups, 1)

    def replicated_rows(self, tp):
        return self.shared if self._replicas(tp) > 1 else 0

    def shard(self, full, dim, rank, tp):
        rep = self._replicas(tp)
        if rep == 1:
            return full.chunk(tp, dim)[rank]
        group = full.narrow(dim, rank // rep * (self.split + self.shared), self.split + self.shared)
        split, shared = group.split([self.split, self.shared], dim)
        return torch.cat([split.chunk(rep, dim)[rank % rep], shared], dim)

    def unshard(self, parts, dim):
        rep = self._replicas(len(parts))
        if rep == 1:
            return torch.cat(parts, dim)
        out = []
        for g in range(self.groups):
            mine = [p.split([self.split // rep, self.shared], dim) for p in parts[g * rep:(g + 1) * rep]]
            out += [m[0] for m in mine] + [mine[0][1]]  # the copies are equal: take the first
        return torch.cat(out, dim)


def layout_from_spec(spec: dict | None) -> ShardLayout | None:
    if not spec:
        return None
    kinds = {"StridedLayout": StridedLayout, "GroupedLayout": GroupedLayout,
             "SegmentLayout": SegmentLayout}
    args = {k: v for k, v in spec.items() if k != "kind"}
    return kinds[spec["kind"]](**args)


def unshard(parts: list[torch.Tensor], dim: int, full_size: int,
            layout: ShardLayout | dict | None = None) -> torch.Tensor:
    """The full tensor from every TP rank's part (rank order): concatenated and trimmed of
    vocabulary padding, or rebuilt by the parameter's layout (a ShardLayout or its spec)."""
    if isinstance(layout, dict):
        layout = layout_from_spec(layout)
    if layout is not None:
        return layout.unshard(parts, dim)
    return torch.cat(parts, dim).narrow(dim, 0, full_size)


class _ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the gradient of a GroupedLayout's shared rows over the
    ranks holding copies of them (each copy saw only its own rank's query heads), so the copies
    get the full gradient and stay equal."""

    @staticmethod
    def forward(ctx, w, layout, topo):
        ctx.layout, ctx.topo = layout, topo
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        layout, topo = ctx.layout, ctx.topo
        rows = layout.replicated_rows(topo.tp)
        own, shared = g.split([g.shape[0] - rows, rows], 0)
        # One all-reduce over the TP group into one slot per group: no extra process groups.
        group = topo.tp_rank // (topo.tp // layout.groups)
        slots = shared.new_zeros((layout.groups,) + tuple(shared.shape))
        slots[group] = shared
        slots = all_reduce(slots, topo.tp_group)
        return torch.cat([own, slots[group]], 0), None, None


def duplicate_rows(param: torch.Tensor, topo: ParallelTopology) -> int:
    """Trailing rows of this rank's shard that another rank holds too and should count instead
    (for a global gradient norm): replicated rows on all but the first copy, else 0."""
    layout = tp_layout(param)
    rows = layout.replicated_rows(topo.tp) if layout is not None else 0
    return rows if rows and topo.tp_rank % (topo.tp // layout.groups) else 0


def replica_grad_sum(param: torch.Tensor, topo: ParallelTopology) -> torch.Tensor:
    """Use a parameter whose layout may replicate rows over TP ranks (see GroupedLayout)."""
    layout = tp_layout(param)
    if layout is None or layout.replicated_rows(topo.tp) == 0:
        return param
    return _ReplicaGradSum.apply(param, layout, topo)


def shard_of(full: torch.Tensor, dim: int, tp_rank: int, tp: int, padded_size: int | None = None,
             layout: ShardLayout | None = None):
    """This rank's slice of a full tensor, zero-padding `dim` to `padded_size` first."""
    if layout is not None:
        return layout.shard(full, dim, tp_rank, tp).clone()
    if padded_size is not None and padded_size > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded_size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    if full.shape[dim] % tp != 0:
        raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} over {tp} ranks")
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def _sharded_parameter(shape_full, dim, topo: ParallelTopology, init_fn: InitFn, dtype,
                       padded_size: int | None = None, layout: ShardLayout | None = None) -> nn.Parameter:
    full = torch.empty(shape_full, dtype=torch.float32)
    init_fn(full)
    local = shard_of(full, dim, topo.tp_rank, topo.tp, padded_size, layout)
    param = nn.Parameter(local.to(device=topo.device, dtype=dtype))
    mark_tensor_parallel(param, dim, shape_full[dim], layout)
    return param


def _replicated_parameter(shape, topo, dtype, init_fn: InitFn | None = None) -> nn.Parameter:
    t = torch.zeros(shape, dtype=torch.float32)
    if init_fn is not None:
        init_fn(t)
    return nn.Parameter(t.to(device=topo.device, dtype=dtype))


def sequence_parallel_param(param: torch.Tensor, topo: ParallelTopology) -> torch.Tensor:
    """Use a TP-replicated parameter inside a sequence-sharded region.

    Each TP rank sees only its chunk of the sequence, so its gradient is partial; routing the
    parameter through copy_to_tp sums the gradient over TP in backward, keeping replicas equal.
    """
    return copy_to_tp(param, topo.tp_group) if topo.sequence_parallel else param


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: each rank computes Y_i = X A_i (output dim sharded).

    Input is replicated [s, b, h] (or sequence-sharded [s/tp, b, h] under sequence parallelism,
    then all-gathered here); output is [s, b, out/tp] unless gather_output.
    A `layout` shards the output dimension other than in contiguous chunks (see ShardLayout).
    """

    def __init__(self, in_features: int, out_features: int, topo: ParallelTopology,
                 init_fn: InitFn, *, bias: bool = True, gather_output: bool = False,
                 dtype=torch.float32, layout: ShardLayout | None = None):
        super().__init__()
        if layout is None and out_features % topo.tp != 0:
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel "
                             f"size {topo.tp}")
        self.topo, self.gather_output = topo, gather_output
        self.weight = _sharded_parameter((out_features, in_features), 0, topo, init_fn, dtype,
                                         layout=layout)
        if bias:
            self.bias = _replicated_parameter((self.weight.shape[0],), topo, dtype)
            mark_tensor_parallel(self.bias, 0, out_features, layout)
        else:
            self.register_parameter("bias", None)
        self.lora = None  # a LoRA adapter (parallel/lora.py) adds its update to the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.topo.tp_group
        bias = None if self.bias is None else replica_grad_sum(self.bias, self.topo)
        weight = replica_grad_sum(self.weight, self.topo)
        if self.topo.sequence_parallel and self.topo.tp > 1:  # keeps the chunk, not the gather
            y = sequence_gathered_linear(x, weight, bias, group)
        else:
            y = linear(copy_to_tp(x, group), weight, bias)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora(x)
        return gather_last_dim(y, group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: input sharded on its last dim, partial outputs summed.

    Under sequence parallelism the sum is a reduce-scatter along the sequence instead.
    """

    def __init__(self, in_features: int, out_features: int, topo: ParallelTopology,
                 init_fn: InitFn, *, bias: bool = True, dtype=torch.float32):
        super().__init__()
        if in_features % topo.tp != 0:
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel "
                             f"size {topo.tp}")
        self.topo = topo
        self.weight = _sharded_parameter((out_features, in_features), 1, topo, init_fn, dtype)
        if bias:
            self.bias = _replicated_parameter((out_features,), topo, dtype)
        else:
            self.register_parameter("bias", None)
        self.lora = None  # a LoRA adapter (parallel/lora.py) adds its update to the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        group = self.topo.tp_group
        if self.topo.sequence_parallel:
            y = reduce_scatter_to_sequence(y, group)
        else:
            y = reduce_from_tp(y, group)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora(x)
        if self.bias is not None:
            y = y + sequence_parallel_param(self.bias, self.topo)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split over TP ranks; lookups are summed over TP."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int,
                 topo: ParallelTopology, init_fn: InitFn, dtype=torch.float32):
        super().__init__()
        self.topo = topo
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.per_rank = padded_vocab_size // topo.tp
        self.start = topo.tp_rank * self.per_rank
        self.weight = _sharded_parameter((vocab_size, hidden_size), 0, topo, init_fn, dtype,
                                         padded_size=padded_vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Row-sparse gradients when whoever collects them says it takes them (the ZeRO
        # optimizer's hooks): no zeroed [vocab, h] gradient per micro-batch, and a tied head's
        # dense gradient absorbs the rows with an index_add instead of a full-size add.
        sparse = spec_of(self.weight).accepts_sparse_grad
        if self.topo.tp == 1:
            return F.embedding(ids, self.weight, sparse=sparse)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, sparse=sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.topo.tp_group)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, topo: ParallelTopology,
                       vocab_size: int) -> torch.Tensor:
    """Logits for this rank's vocabulary shard, [s, b, v/tp]; padded entries are -inf."""
    group = topo.tp_group
    hidden = gather_from_sequence(hidden, group) if topo.sequence_parallel else copy_to_tp(hidden, group)
    logits = F.linear(hidden, weight)
    per_rank = weight.shape[0]
    start = topo.tp_rank * per_rank
    if start + per_rank > vocab_size:  # padded rows must never win a softmax or an argmax
        pad = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    return logits
