"""Full tensors from another framework's per-rank pieces, checked against the model's shapes.

A `Pieces` collects, per megazoo canonical name (and expert index for routed experts), every
copy of every tensor-parallel rank's part. `full()` joins the parts by their split kind
(`names.py`), averages copies that should be equal but drifted apart (replicated norms and
row-parallel biases on each TP rank, a tied embedding's copy on the last pipeline stage; as
Hugging Face's own BLOOM converter does) and says so in one line with the largest drift.
`check_shapes` refuses tensors whose shapes disagree with the recorded configuration, naming both.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import torch

from megazoo.models.config import TransformerConfig

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import names
from megazoo.training.checkpoint.layout_writer import build_rank_chunks
from megazoo.training.checkpoint.param_table import param_table

logger = logging.getLogger(__name__)


class Pieces:
    def __init__(self, where: str):
        self.where = where
        self.parts = defaultdict(lambda: defaultdict(dict))  # (canon, expert) -> copy -> tp -> t
        self.split: dict[str, str] = {}

    def add(self, canon: str, split: str, expert: int | None, tp_rank: int, tensor, copy=0):
        self.split[canon] = split
        self.parts[(canon, expert)][copy][tp_rank] = tensor

    def full(self, tp: int, vocab_size: int) -> dict[str, torch.Tensor]:
        drift = []  # (largest difference, name) of every averaged set of copies
        joined = {}
        for (canon, expert), copies in self.parts.items():
            split, merged = self.split[canon], []
            for copy, by_rank in copies.items():
                if split != "replicated" and sorted(by_rank) != list(range(tp)):
                    raise ckpt.CheckpointError(f"{self.where}: {canon} lacks tensor-parallel "
                                               f"ranks {sorted(set(range(tp)) - set(by_rank))}")
                ordered = [by_rank[r] for r in sorted(by_rank)]
                merged.append(names.unshard(ordered, split, vocab_size) if split != "replicated"
                              else _mean(ordered, canon, drift))
            joined[(canon, expert)] = _mean(merged, canon, drift)
        if drift:
            worst = max(drift)
            logger.warning("%s: averaged %d sets of copies that differ across ranks (as HF's BLOOM "
                           "converter does); largest drift %.3g in %s", self.where, len(drift),
                           worst[0], worst[1])
        out, experts = {}, defaultdict(dict)
        for (canon, expert), t in joined.items():
            if expert is None:
                out[canon] = t
            else:
                experts[canon][expert] = t
        for canon, by_expert in experts.items():
            if sorted(by_expert) != list(range(len(by_expert))):
                raise ckpt.CheckpointError(f"{self.where}: {canon} lacks experts "
                                           f"{sorted(set(range(max(by_expert) + 1)) - set(by_expert))}")
            out[canon] = torch.stack([by_expert[e] for e in range(len(by_expert))])
        return out


def _mean(copies: list[torch.Tensor], canon: str, drift: list) -> torch.Tensor:
    first = copies[0]
    if all(torch.equal(first, t) for t in copies[1:]):
        return first
    if any(t.shape != first.shape for t in copies):
        raise ckpt.CheckpointError(f"{canon}: copies of shapes {sorted({tuple(t.shape) for t in copies})}")
    diff = max((t.float() - first.float()).abs().max().item() for t in copies[1:])
    drift.append((diff, canon))
    return torch.stack([t.float() for t in copies]).mean(0).to(first.dtype)


def expected_shapes(family_name: str, config: TransformerConfig, *, frozen: bool = False):
    """canonical name -> full (unpadded) shape of every trained tensor of the model; with
    `frozen`, (that of every tensor, frozen ones included, and the set of frozen names: the
    router's expert bias, a weight without optimizer state)."""
    if config.family != family_name:
        raise ValueError(f"the checkpoint's settings make a {config.family!r} model, its reader "
                         f"named {family_name!r}")
    _, chunks = build_rank_chunks(config, tp=1, pp=1, vpp=1, dp=1, rank=0)
    shapes, frozen_names = {}, set()
    for row in param_table(chunks, frozen=frozen):
        shape = list(row.shape)
        if row.tp_dim >= 0:
            shape[row.tp_dim] = row.full_size
        shapes[row.canonical] = tuple(shape)
        if row.frozen:
            frozen_names.add(row.canonical)
    return (shapes, frozen_names) if frozen else shapes


def check_shapes(full: dict[str, torch.Tensor], expected: dict[str, tuple], where: str,
                 recorded: str) -> None:
    """Refuse tensors that disagree with the configuration (`recorded` names its source)."""
    missing = sorted(set(expected) - set(full))
    if missing:
        raise ckpt.CheckpointError(f"{where} lacks {len(missing)} tensors that {recorded} call "
                                   f"for, e.g. {missing[:3]}")
    extra = sorted(set(full) - set(expected))
    if extra:
        raise ckpt.CheckpointError(f"{where} holds {len(extra)} tensors that {recorded} do not "
                                   f"call for, e.g. {extra[:3]}")
    for canon, shape in expected.items():
        if tuple(full[canon].shape) != shape:
            raise ckpt.CheckpointError(f"{where}: {canon} has shape {tuple(full[canon].shape)}, "
                                       f"{recorded} give {shape}; the checkpoint and its "
                                       f"arguments disagree")
