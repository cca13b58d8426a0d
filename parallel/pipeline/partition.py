"""Which transformer layers sit on which (pipeline rank, virtual chunk).

The model is cut into `pp * vpp` contiguous blocks ("virtual stages") numbered in model order.
Megatron's interleaved placement puts block `s` on rank `s % pp` as that rank's chunk `s // pp`,
so rank r holds blocks r, r + pp, r + 2*pp, ... An activation therefore travels
rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ... and the pipeline is walked vpp times.

The embedding lives in block 0 (rank 0, chunk 0); the final norm, head and loss in the last block
(rank pp-1, chunk vpp-1). Those stages also do extra work, which is why an explicit option may give
the first and last rank fewer layers than the others.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazoo.parallel.errors import LayoutError
from megazoo.parallel.pipeline.layer_layout import check_layout


@dataclass(frozen=True)
class ChunkSpec:
    """What one model chunk builds: `TransformerLanguageModel(config, topo, **spec.kwargs())`."""

    rank: int
    chunk: int
    stage: int  # index of this block along the model: chunk * pp + rank
    layer_range: tuple[int, int]  # [start, stop) global layer indices
    pre_process: bool  # holds the embedding (first virtual stage)
    post_process: bool  # holds final norm, head and loss (last virtual stage)

    def kwargs(self) -> dict:
        return dict(pre_process=self.pre_process, post_process=self.post_process,
                    layer_range=self.layer_range)


def block_sizes(num_layers: int, pp: int, vpp: int = 1, *, first_stage_layers: int | None = None,
                last_stage_layers: int | None = None, stage_layout: tuple | None = None) -> list[int]:
    """Layers per block in model order (block s goes to rank s % pp, chunk s // pp).

    Without options every block gets num_layers / (pp*vpp) layers and anything else is an error.
    `first_stage_layers` / `last_stage_layers` fix the total on rank 0 / rank pp-1 (split evenly
    over that rank's vpp chunks, as Megatron does); the remaining layers are split evenly over the
    other ranks' blocks. `stage_layout` (--pipeline-model-parallel-layout, parsed): the layers of
    every block, given outright.
    """
    if pp < 1 or vpp < 1:
        raise LayoutError(f"pipeline sizes must be >= 1, got pp={pp} vpp={vpp}")
    if stage_layout is not None:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise LayoutError("give one of --pipeline-model-parallel-layout and "
                              "--decoder-first/last-pipeline-num-layers")
        return check_layout(stage_layout, num_layers, pp, vpp)
    blocks = pp * vpp
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % blocks != 0:
            raise LayoutError(
                f"--num-layers {num_layers} is not divisible by pp {pp} x vpp {vpp} = {blocks}; "
                f"change --num-layers, or split unevenly with --decoder-first-pipeline-num-layers / "
                f"--decoder-last-pipeline-num-layers")
        return [num_layers // blocks] * blocks
    if pp == 1:
        raise LayoutError("--decoder-first/last-pipeline-num-layers need "
                          "--pipeline-model-parallel-size > 1 (one stage is both)")

    per_rank = {}  # rank -> total layers on that rank
    for rank, value, name in ((0, first_stage_layers, "first_stage_layers"),
                              (pp - 1, last_stage_layers, "last_stage_layers")):
        if value is None:
            continue
        if value < 0 or value % vpp != 0:
            raise LayoutError(f"--decoder-{name.split('_')[0]}-pipeline-num-layers {value} must be "
                              f">= 0 and divisible by the virtual stages per rank ({vpp})")
        per_rank[rank] = value
    free_ranks = [r for r in range(pp) if r not in per_rank]
    rest = num_layers - sum(per_rank.values())
    if rest < 0:
        raise LayoutError(f"--decoder-first/last-pipeline-num-layers {per_rank} exceed "
                          f"--num-layers {num_layers}")
    if free_ranks:
        if rest % (len(free_ranks) * vpp) != 0:
            raise LayoutError(
                f"the remaining {rest} layers do not split evenly over {len(free_ranks)} ranks x "
                f"vpp {vpp}; adjust --decoder-first/last-pipeline-num-layers or --num-layers")
        for r in free_ranks:
            per_rank[r] = rest // len(free_ranks)
    elif rest != 0:
        raise LayoutError(f"--decoder-first-pipeline-num-layers + --decoder-last-pipeline-num-layers "
                          f"must equal --num-layers "
                          f"{num_layers} when pp = 2")
    return [per_rank[s % pp] // vpp for s in range(blocks)]


def partition(num_layers: int, pp: int, vpp: int = 1, *, first_stage_layers: int | None = None,
              last_stage_layers: int | None = None,
              stage_layout: tuple | None = None) -> list[list[ChunkSpec]]:
    """`specs[rank][chunk]` for every rank of a pipeline (pure; the same on every process)."""
    sizes = block_sizes(num_layers, pp, vpp, first_stage_layers=first_stage_layers,
                        last_stage_layers=last_stage_layers, stage_layout=stage_layout)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    last = pp * vpp - 1
    def spec(r: int, v: int) -> ChunkSpec:
        s = v * pp + r
        return ChunkSpec(rank=r, chunk=v, stage=s, layer_range=(starts[s], starts[s] + sizes[s]),
                         pre_process=(s == 0), post_process=(s == last))
    return [[spec(r, v) for v in range(vpp)] for r in range(pp)]


def chunk_prefix(chunk: int, num_chunks: int) -> str:
    """How a rank with several model chunks names their parameters: "chunk{c}." before each
    name (nothing with one chunk). The optimizer and the checkpoint tables both use it."""
    return f"chunk{chunk}." if num_chunks > 1 else ""
