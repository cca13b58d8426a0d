"""The optimizer's share of the model states, following the optimizer the run chose.

Per parameter, before ZeRO sharding: the fp32 master copy when the weights are 16-bit, and one
fp32 tensor per state of the optimizer that steps it, named by the optimizer itself
(parallel/zero/inner.py, parallel/zero/muon.py): AdamW's two moments; SGD's momentum buffer when
it has momentum; under --optimizer muon one momentum buffer for the matrices Muon takes, AdamW's
moments for the rest. Which parameters Muon takes is the optimizer's own rule
(`parallel.zero.muon.uses_muon`), applied to this rank's modules built on the meta device: one
layer of each kind and the stage's ends, at the layout's tp and ep, so the count is the
optimizer's own, element for element.
"""
from __future__ import annotations

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.registry import build_model
from megazoo.parallel.param_spec import spec_of
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero.inner import build_inner
from megazoo.parallel.zero.muon import Muon, uses_muon

from megazoo.training.planning.layout import Layout

META = torch.device("meta")
STATE_BYTES = 4  # every optimizer state is fp32 (parallel/zero/optimizer.py's state store)


def state_bytes(layout: Layout, muon: bool = False) -> float:
    """Optimizer bytes of one parameter before ZeRO: its master (16-bit weights) and states;
    `muon`: of a matrix Muon steps (only under --optimizer muon)."""
    opt = layout.optimizer
    inner = Muon if muon else build_inner(opt.optimizer, opt.betas, opt.eps, opt.momentum)
    master = 0 if layout.dtype == torch.float32 else STATE_BYTES
    return master + STATE_BYTES * len(inner.state_names)


def _muon_numel(chunk, settings) -> tuple[int, int]:
    """(dense, expert) trainable elements of `chunk` that Muon steps, by the optimizer's rule."""
    dense = expert = 0
    for name, p in chunk.named_parameters():
        if p.requires_grad and uses_muon(name, p, settings):
            if spec_of(p).expert:
                expert += p.numel()
            else:
                dense += p.numel()
    return dense, expert


def rank_muon_params(cfg: TransformerConfig, layout: Layout, layer_ids: list[int],
                     stage: str) -> tuple[float, float]:
    """(dense, expert) parameters Muon steps on a pipeline rank holding the layers `layer_ids`
    and the ends of `stage` ("first", "middle", "last", "only"); (0, 0) unless the optimizer is
    muon. Layers of one kind (MoE or dense) have the same parameters: one of each is built."""
    if layout.optimizer.optimizer != "muon":
        return 0.0, 0.0
    settings = layout.optimizer.muon
    topo = ParallelTopology(config=layout.parallel, rank=0, world_size=layout.world,
                            dp=layout.dp, device=META)
    topo.group_ranks = topo.grid.groups_of(0)

    def built(**kwargs) -> tuple[int, int]:
        with torch.device(META):
            return _muon_numel(build_model(cfg, topo, **kwargs), settings)
    ends = built(pre_process=stage in ("first", "only"), post_process=stage in ("last", "only"),
                 layer_range=(0, 0))
    per_kind: dict[bool, tuple[int, int]] = {}
    dense, expert = ends
    for i in layer_ids:
        kind = cfg.is_moe_layer(i)
        if kind not in per_kind:
            per_kind[kind] = built(pre_process=False, post_process=False, layer_range=(i, i + 1))
        dense, expert = dense + per_kind[kind][0], expert + per_kind[kind][1]
    return float(dense), float(expert)
