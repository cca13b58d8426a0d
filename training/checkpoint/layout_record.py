"""The layout a checkpoint records in meta.json (`layout`), written by a training run's save and by
the one-process layout writer alike, and read back as the one layout object, `ParallelConfig`.

Dimensions added later (cp, ep, an uneven pipeline split) are recorded only when used, so older
checkpoints of the same layout still compare equal.
"""
from __future__ import annotations

from megazoo.parallel.layout import ParallelConfig


def layout_record(parallel: ParallelConfig, *, dp: int, zero_stage: int) -> dict:
    world = parallel.tp * parallel.pp * parallel.cp * dp
    layout = dict(tp=parallel.tp, pp=parallel.pp, dp=dp, vpp=parallel.vpp, world_size=world,
                  zero_stage=zero_stage)
    layout.update({k: v for k, v in dict(cp=parallel.cp, ep=parallel.ep).items() if v != 1})
    layout.update({k: v for k, v in dict(first_stage_layers=parallel.first_stage_layers,
                                         last_stage_layers=parallel.last_stage_layers).items()
                   if v is not None})
    if parallel.stage_layout is not None:
        layout["stage_layout"] = list(parallel.stage_layout)
    return layout


def parallel_of_record(layout: dict) -> ParallelConfig:
    """The `ParallelConfig` of a recorded layout (what shapes the files: sequence parallelism
    and the context-parallel comm type leave no trace in them)."""
    return ParallelConfig(tp=layout["tp"], pp=layout.get("pp", 1), vpp=layout.get("vpp", 1),
                          cp=layout.get("cp", 1), ep=layout.get("ep", 1),
                          first_stage_layers=layout.get("first_stage_layers"),
                          last_stage_layers=layout.get("last_stage_layers"),
                          stage_layout=tuple(layout["stage_layout"])
                          if layout.get("stage_layout") is not None else None)
