"""The parameter table: what every rank file says about each parameter it holds, so that a
checkpoint of one layout can be read at any other (`reshard.py`, `slices.py`).

Every rank file carries the table (`PARAMS`, JSON in a uint8 tensor), one `ParamRow` per parameter
in the optimizer's order: the trainable parameters first (the ZeRO buckets' `ranges` rows index
them), then the frozen ones (weights only, no optimizer state). On disk a row is a JSON list in
the field order of `ParamRow`; its two last fields are optional there (files written before
megazoo recorded them read as False), and a frozen flag is written only where it is true.

meta.json's `slices` record keeps, per canonical tensor, a `SliceEntry` (also a JSON list on
disk): the TP split and local shape once for the whole checkpoint, and the pipeline stages whose
files hold it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazoo.parallel.param_spec import spec_of
from megazoo.parallel.pipeline.partition import chunk_prefix

PARAMS = "megazoo.params"  # the parameter table's key in every rank file


@dataclass(frozen=True)
class ParamRow:
    """One parameter of one rank's chunks."""

    chunk: int  # the model chunk (virtual pipeline stage) on this rank
    name: str  # its name inside the chunk
    canonical: str  # its name independent of layout (global layer numbers)
    shape: list[int]  # its local (TP-sharded) shape, padding included
    tp_dim: int  # the dim tensor parallelism splits (-1: replicated)
    full_size: int  # the full, unpadded size of that dim (0 when replicated)
    layout: dict | None  # the shard layout spec (None: contiguous chunks)
    expert: bool = False  # an MoE expert weight, its experts split over expert parallelism (dim 0)
    frozen: bool = False  # requires_grad=False (e.g. the router's expert bias): weights only

    @classmethod
    def from_json(cls, row: list) -> "ParamRow":
        chunk, name, canonical, shape, tp_dim, full_size = row[:6]
        return cls(chunk, name, canonical, list(shape), tp_dim, full_size,
                   row[6] if len(row) > 6 else None,
                   bool(row[7]) if len(row) > 7 else False,
                   bool(row[8]) if len(row) > 8 else False)

    def to_json(self) -> list:
        return ([self.chunk, self.name, self.canonical, list(self.shape), self.tp_dim,
                 self.full_size, self.layout, self.expert] + ([True] if self.frozen else []))


def table_order(chunks) -> list[tuple[int, str, torch.nn.Parameter]]:
    """(chunk, name, parameter) in the parameter table's order: the trainable ones chunk by chunk
    (the optimizer's order), then the frozen ones."""
    named = [(c, n, p) for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()]
    return [t for t in named if t[2].requires_grad] + [t for t in named if not t[2].requires_grad]


def param_table(chunks, opt=None, *, frozen: bool = False) -> list[ParamRow]:
    """The parameter table of one rank's chunks: its trainable rows in the optimizer's parameter
    order, then (frozen: checkpoints' tables) the frozen ones."""
    rows = []
    for c, n, p in table_order(chunks):
        if not (frozen or p.requires_grad):
            continue
        canonical = getattr(chunks[c], "canonical_name", lambda n: n)
        split = spec_of(p).tp_split
        layout = split.layout if split else None
        rows.append(ParamRow(c, n, canonical(n), list(p.shape), split.dim if split else -1,
                             split.full_size if split else 0,
                             layout.spec() if layout else None, bool(spec_of(p).expert),
                             not p.requires_grad))
    if opt is not None:  # the optimizer numbers parameters the same way; make sure of it
        trained = [chunk_prefix(r.chunk, len(chunks)) + r.name for r in rows if not r.frozen]
        if trained != list(opt.param_names):
            raise RuntimeError("the optimizer's parameter order differs from the chunks'; "
                               "training/checkpoint/param_table.py must follow "
                               "parallel/zero/optimizer.py")
    return rows


def table_json(rows: list[ParamRow]) -> list[list]:
    return [r.to_json() for r in rows]


def table_from_json(rows: list[list]) -> list[ParamRow]:
    return [ParamRow.from_json(r) for r in rows]


@dataclass
class SliceEntry:
    """One canonical tensor in meta.json's `slices` record."""

    tp_dim: int
    shape: list[int]  # local shape
    layout: dict | None
    expert: bool
    stages: list[int]  # the pipeline stages whose files hold it
    frozen: bool = False

    @classmethod
    def of_row(cls, row: ParamRow, stage: int) -> "SliceEntry":
        return cls(row.tp_dim, list(row.shape), row.layout, row.expert, [stage], row.frozen)

    @classmethod
    def from_json(cls, entry: list) -> "SliceEntry":
        return cls(entry[0], list(entry[1]), entry[2], bool(entry[3]), list(entry[4]),
                   bool(entry[5]) if len(entry) > 5 else False)

    def to_json(self) -> list:
        return ([self.tp_dim, list(self.shape), self.layout, self.expert, list(self.stages)]
                + ([True] if self.frozen else []))
