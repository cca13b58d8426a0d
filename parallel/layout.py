"""The parallel layout: what a user asks for, whether it fits, and which rank sits where.

This file is the one home of every layout rule. `ParallelConfig.validate` checks a layout against
the world size and `ParallelConfig.check_model` against a model's shape; both run before any
process group or weight exists, and every refusal is one line naming the flag to change. The
trainer, the converters, the resharder and the planner all call these two methods.

Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (they talk most, so they share
a node), then context-parallel, then data-parallel, then pipeline-parallel:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Expert parallelism is carved out of the dp x cp ranks of one (pp, tp) position: consecutive
groups of `ep` of them split the experts, and the ranks holding the same experts form the
expert-data-parallel group over which expert gradients are reduced.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

from .errors import LayoutError
from .pipeline.partition import block_sizes, partition

logger = logging.getLogger(__name__)


class Coords(NamedTuple):
    """A rank's position on every axis."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class ParallelConfig:
    """The layout a user asks for (Megatron flag names in comments)."""

    tp: int = 1  # --tensor-model-parallel-size
    pp: int = 1  # --pipeline-model-parallel-size
    vpp: int = 1  # virtual pipeline chunks per rank (from --num-layers-per-virtual-pipeline-stage)
    sequence_parallel: bool = False  # --sequence-parallel
    cp: int = 1  # --context-parallel-size
    cp_comm_type: str = "p2p"  # --cp-comm-type: p2p (ring attention) | a2a (all-to-all, Ulysses)
    ep: int = 1  # --expert-model-parallel-size
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    stage_layout: tuple[int, ...] | None = None  # --pipeline-model-parallel-layout: layers per block

    # ---- against the world size ----------------------------------------------------------
    @classmethod
    def of(cls, parallel: "ParallelConfig | None" = None, **sizes) -> "ParallelConfig":
        """`parallel`, or one made of field values (`tp=2, pp=2`): for functions that take the
        layout as one object and let a caller spell a small one by its sizes."""
        if parallel is not None and sizes:
            raise TypeError(f"give a ParallelConfig or its fields ({sorted(sizes)}), not both")
        return parallel if parallel is not None else cls(**sizes)

    def validate(self, world_size: int) -> int:
        """Check the layout against the world size and return the data-parallel size."""
        for flag, value in (("--tensor-model-parallel-size", self.tp),
                            ("--pipeline-model-parallel-size", self.pp),
                            ("--context-parallel-size", self.cp),
                            ("--expert-model-parallel-size", self.ep),
                            ("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage)",
                             self.vpp)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{flag} must be an integer >= 1, got {value}")
        if self.cp_comm_type not in ("p2p", "a2a"):
            raise LayoutError(f"--cp-comm-type {self.cp_comm_type!r} is not supported; choose p2p "
                              f"(ring attention) or a2a (all-to-all)")
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel != 0:
            raise LayoutError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {self.tp}"
                f" x --context-parallel-size {self.cp} x --pipeline-model-parallel-size {self.pp}"
                f" = {model_parallel}; launch a multiple of {model_parallel} processes")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("virtual pipeline stages need --pipeline-model-parallel-size > 1; drop "
                              "--num-layers-per-virtual-pipeline-stage or raise the pipeline size")
        if (self.first_stage_layers is not None or self.last_stage_layers is not None) \
                and self.pp == 1:
            raise LayoutError("--decoder-first/last-pipeline-num-layers need "
                              "--pipeline-model-parallel-size > 1")
        if self.stage_layout is not None and len(self.stage_layout) != self.pp * self.vpp:
            raise LayoutError(f"--pipeline-model-parallel-layout lists {len(self.stage_layout)} "
                              f"stages; --pipeline-model-parallel-size {self.pp} x virtual "
                              f"{self.vpp} needs {self.pp * self.vpp}")
        dp = world_size // model_parallel
        if (dp * self.cp) % self.ep != 0:
            raise LayoutError(
                f"--expert-model-parallel-size {self.ep} must divide data-parallel x context-parallel"
                f" size {dp} x {self.cp} = {dp * self.cp} (experts are split over data-parallel ranks)")
        if self.sequence_parallel and self.tp == 1:
            logger.info("--sequence-parallel has no effect with tensor-model-parallel-size 1")
        return dp

    # ---- against the model ---------------------------------------------------------------
    def check_model(self, *, num_layers: int, num_attention_heads: int,
                    num_query_groups: int | None = None, ffn_hidden_size: int | None = None,
                    seq_length: int | None = None, num_experts: int | None = None,
                    shared_expert_size: int | None = None) -> None:
        """Model-dependent checks, run before any process group or weight is created."""
        tp = self.tp
        if num_attention_heads % tp != 0:
            raise LayoutError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; pick a tp that divides the head count")
        groups = num_query_groups or num_attention_heads
        if groups % tp != 0 and tp % groups != 0:
            raise LayoutError(
                f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must divide "
                f"the other (split whole KV heads, or replicate each)")
        if self.cp > 1 and self.cp_comm_type == "a2a":
            heads_local, groups_local = num_attention_heads // tp, max(groups // tp, 1)
            if heads_local % self.cp or groups_local % self.cp:
                raise LayoutError(
                    f"--cp-comm-type a2a needs the {heads_local} heads and {groups_local} key/value "
                    f"heads per tensor-parallel rank divisible by --context-parallel-size "
                    f"{self.cp}; use --cp-comm-type p2p or a context size that divides both")
        for flag, size in (("--ffn-hidden-size", ffn_hidden_size),
                           ("--moe-shared-expert-intermediate-size", shared_expert_size)):
            if size is not None and size % tp != 0:
                raise LayoutError(
                    f"{flag} {size} (HF intermediate_size) is not divisible by "
                    f"--tensor-model-parallel-size {tp}; pick a tp that divides it")
        self.layers_per_block(num_layers)
        if seq_length is not None:
            split = (tp if self.sequence_parallel and tp > 1 else 1) * (2 * self.cp if self.cp > 1 else 1)
            if seq_length % split != 0:
                raise LayoutError(
                    f"--seq-length {seq_length} must be divisible by {split} (tensor-parallel size "
                    f"under --sequence-parallel x 2 x --context-parallel-size)")
        if self.ep > 1:
            if not num_experts:
                raise LayoutError("--expert-model-parallel-size > 1 needs a mixture-of-experts model "
                                  "(--num-experts)")
            if num_experts % self.ep != 0:
                raise LayoutError(f"--num-experts {num_experts} is not divisible by "
                                  f"--expert-model-parallel-size {self.ep}")

    def layers_per_block(self, num_layers: int) -> list[int]:
        """Layers in each of the pp * vpp pipeline blocks, in model order (see partition.py)."""
        return block_sizes(num_layers, self.pp, self.vpp, first_stage_layers=self.first_stage_layers,
                           last_stage_layers=self.last_stage_layers, stage_layout=self.stage_layout)

    def chunk_specs(self, num_layers: int, pp_rank: int) -> list:
        """The model chunks (`ChunkSpec`s) pipeline rank `pp_rank` builds, in chunk order."""
        return partition(num_layers, self.pp, self.vpp, first_stage_layers=self.first_stage_layers,
                         last_stage_layers=self.last_stage_layers,
                         stage_layout=self.stage_layout)[pp_rank]

    def grid(self, world_size: int) -> "Grid":
        return Grid(tp=self.tp, cp=self.cp, dp=self.validate(world_size), pp=self.pp, ep=self.ep)


def virtual_stages(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """vpp from Megatron's --num-layers-per-virtual-pipeline-stage (1 when not given)."""
    if not layers_per_virtual_stage:
        return 1
    if pp < 1 or num_layers % pp or (num_layers // pp) % layers_per_virtual_stage:
        raise LayoutError(
            f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} does not divide the "
            f"{num_layers} / {pp} layers per pipeline stage")
    return num_layers // pp // layers_per_virtual_stage


def microbatches_per_step(global_batch: int, micro_batch: int, dp: int, pp: int = 1,
                          vpp: int = 1) -> int:
    """Microbatches each data-parallel replica runs per step; refuses batch sizes that don't fit."""
    if micro_batch < 1 or global_batch < 1:
        raise LayoutError(f"--micro-batch-size ({micro_batch}) and --global-batch-size "
                          f"({global_batch}) must be >= 1")
    if global_batch % (micro_batch * dp):
        raise LayoutError(f"--global-batch-size {global_batch} is not divisible by "
                          f"--micro-batch-size {micro_batch} x data-parallel size {dp}")
    n = global_batch // (micro_batch * dp)
    if vpp > 1 and n % pp:
        raise LayoutError(f"interleaved pipelining needs the {n} microbatches per step "
                          f"(--global-batch-size / (--micro-batch-size x dp)) to be a multiple of "
                          f"--pipeline-model-parallel-size {pp}")
    return n


@dataclass(frozen=True)
class Grid:
    """The rank grid of a world: coordinates both ways and every group (pure; no processes)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return Coords(pp=rest // self.dp, dp=rest % self.dp, cp=cp, tp=tp)

    def _vary(self, axes: str) -> list[list[int]]:
        """Groups of ranks that differ only along `axes` (letters of 'pdct'), in rank order."""
        sizes = dict(p=self.pp, d=self.dp, c=self.cp, t=self.tp)
        out: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(v for a, v in zip("pdct", c) if a not in axes)
            out.setdefault(key, []).append(r)
        assert all(len(g) == _prod(sizes[a] for a in axes) for g in out.values())
        return list(out.values())

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, as lists of global ranks."""
        g = {"tp": self._vary("t"), "cp": self._vary("c"), "dp": self._vary("d"),
             "dp_cp": self._vary("dc"), "pp": self._vary("p"), "mp": self._vary("pt")}
        # Embedding group: first and last stage of each pipeline (they hold the tied word embedding).
        g["embedding"] = [sorted({ranks[0], ranks[-1]}) for ranks in g["pp"]]
        # Experts: the dp x cp ranks of one (pp, tp) position, in blocks of ep consecutive ones.
        g["ep"] = [ranks[i:i + self.ep] for ranks in g["dp_cp"]
                   for i in range(0, len(ranks), self.ep)]
        g["edp"] = [ranks[i::self.ep] for ranks in g["dp_cp"] for i in range(self.ep)]
        return g

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """The groups `rank` belongs to, computed from its coordinates alone (O(group size))."""
        c = self.coords(rank)
        r = self.rank
        dc = [r(c.pp, d, k, c.tp) for d in range(self.dp) for k in range(self.cp)]
        pp = [r(p, c.dp, c.cp, c.tp) for p in range(self.pp)]
        i = dc.index(rank)
        block = i // self.ep * self.ep
        return {"tp": [r(c.pp, c.dp, c.cp, t) for t in range(self.tp)],
                "cp": [r(c.pp, c.dp, k, c.tp) for k in range(self.cp)],
                "dp": [r(c.pp, d, c.cp, c.tp) for d in range(self.dp)],
                "dp_cp": dc, "pp": pp,
                "mp": [r(p, c.dp, c.cp, t) for p in range(self.pp) for t in range(self.tp)],
                "embedding": sorted({pp[0], pp[-1]}),
                "ep": dc[block:block + self.ep], "edp": dc[i % self.ep::self.ep]}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
