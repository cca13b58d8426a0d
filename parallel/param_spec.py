"""What megazoo records on a parameter: one typed record, one setter, one reader.

Layers say how they built a parameter (its tensor-parallel split, whether it is the tied word
embedding, whether it is an expert's); the gradient sync attaches its fast paths while an
optimizer owns the parameter. Everything that needs to know (checkpoints, resharding, ZeRO
buckets, gradient norms, converters) reads `spec_of(param)`; nothing else is set on parameters.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

_ATTR = "megazoo_spec"


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a parameter is cut over the tensor-parallel ranks."""

    dim: int  # the dimension split over TP ranks
    full_size: int  # that dimension's unpadded global size (vocabulary padding aside)
    layout: "object | None" = None  # a ShardLayout when shards are not contiguous chunks


@dataclass(frozen=True)
class ParamSpec:
    tp_split: TensorParallelSplit | None = None  # None: replicated over TP
    tied_embedding: bool = False  # the word embedding, held by the first and the last stage
    expert: bool = False  # an MoE expert's weight: reduced over the expert-data-parallel group
    # Attached by the gradient sync while an optimizer owns the parameter (see grad_fusion.py):
    accumulate_wgrad: Callable | None = None  # writes a weight gradient straight into its bucket
    accepts_sparse_grad: bool = False  # the embedding may hand over row-sparse gradients

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_split is not None


_DEFAULT = ParamSpec()


def spec_of(param: torch.Tensor) -> ParamSpec:
    """The parameter's record (the default one: replicated, nothing attached, when none was set)."""
    return getattr(param, _ATTR, _DEFAULT)


def set_spec(param: torch.Tensor, **changes) -> ParamSpec:
    """Change fields of the parameter's record (the only way a record is written)."""
    spec = dataclasses.replace(spec_of(param), **changes)
    setattr(param, _ATTR, spec)
    return spec
