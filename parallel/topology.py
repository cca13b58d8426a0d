"""Process topology: which rank holds which (pipeline, data, tensor) coordinate, and its groups.

Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (they talk most, so they
share a node), then data-parallel, then pipeline-parallel:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

A `ParallelTopology` is an explicit object handed to every layer, schedule and optimizer that
needs to communicate; nothing reads a global. With world size 1 every group is `None` and every
collective in `parallel.comm` is the identity, so the same model code runs unsharded.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the flag to change."""


@dataclass(frozen=True)
class ParallelConfig:
    """The layout a user asks for (Megatron flag names in comments)."""

    tp: int = 1  # --tensor-model-parallel-size
    pp: int = 1  # --pipeline-model-parallel-size
    vpp: int = 1  # virtual pipeline chunks per rank (from --num-layers-per-virtual-pipeline-stage)
    sequence_parallel: bool = False  # --sequence-parallel

    def validate(self, world_size: int) -> int:
        """Check the layout against the world size and return the data-parallel size."""
        for name, flag, value in (("tp", "--tensor-model-parallel-size", self.tp),
                                  ("pp", "--pipeline-model-parallel-size", self.pp),
                                  ("vpp", "--num-layers-per-virtual-pipeline-stage", self.vpp)):
            if value < 1:
                raise LayoutError(f"{flag} must be >= 1, got {value} ({name})")
        if world_size % (self.tp * self.pp) != 0:
            raise LayoutError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {self.tp} "
                f"x --pipeline-model-parallel-size {self.pp}; launch tp*pp*dp processes")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        if self.sequence_parallel and self.tp == 1:
            logger.info("--sequence-parallel has no effect with tensor-model-parallel-size 1")
        return world_size // (self.tp * self.pp)

    def validate_model(self, *, num_layers: int, num_attention_heads: int,
                       num_query_groups: int | None = None) -> None:
        """Model-dependent checks, run before any process group or weight is created."""
        if num_attention_heads % self.tp != 0:
            raise LayoutError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {self.tp}; pick a tp that divides the head count")
        if num_query_groups is not None and num_query_groups % self.tp != 0 \
                and self.tp % num_query_groups != 0:
            raise LayoutError(
                f"--num-query-groups {num_query_groups} and --tensor-model-parallel-size {self.tp} "
                f"must divide one another")
        chunks = self.pp * self.vpp
        if num_layers % chunks != 0:
            raise LayoutError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{self.pp} x virtual stages {self.vpp} = {chunks}; change --num-layers or the "
                f"pipeline layout")


def _coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank in Megatron order."""
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return pp_rank * tp * dp + dp_rank * tp + tp_rank


def group_rank_lists(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks (pure; testable without processes)."""
    r = lambda p, d, t: rank_of(p, d, t, tp, dp)  # noqa: E731
    groups = {
        "tp": [[r(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[r(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[r(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [[r(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    # Embedding group: first and last stage of each pipeline (they hold the tied word embedding).
    groups["embedding"] = [sorted({ranks[0], ranks[-1]}) for ranks in groups["pp"]]
    return groups


@dataclass
class ParallelTopology:
    """This rank's coordinates and process groups. Groups are None when their size is 1."""

    config: ParallelConfig
    rank: int = 0
    world_size: int = 1
    dp: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # kind -> ProcessGroup | None
    group_ranks: dict = field(default_factory=dict)  # kind -> list of global ranks in my group

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def single(cls, config: ParallelConfig | None = None, device: torch.device | str = "cpu"):
        """The unsharded topology: one process, no groups. Used by references and tools."""
        config = config or ParallelConfig()
        if config.tp * config.pp != 1:
            raise LayoutError("a single-process topology needs tp = pp = 1")
        return cls(config=config, device=torch.device(device),
                   group_ranks={k: [0] for k in ("tp", "dp", "pp", "mp", "embedding")})

    @classmethod
    def from_config(cls, config: ParallelConfig) -> "ParallelTopology":
        """Build from an initialised default process group (see `init_distributed`)."""
        if not dist.is_available() or not dist.is_initialized():
            return cls.single(config)
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = config.validate(world)
        topo = cls(config=config, rank=rank, world_size=world, dp=dp, device=default_device())
        # Every rank must create every group, in the same order, even those it is not in.
        for kind, lists in group_rank_lists(config.tp, config.pp, dp).items():
            for ranks in lists:
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    topo.groups[kind] = group
                    topo.group_ranks[kind] = ranks
        return topo

    # ---- coordinates --------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def vpp(self) -> int:
        return self.config.vpp

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel and self.config.tp > 1

    @property
    def coords(self) -> tuple[int, int, int]:
        return _coords(self.rank, self.tp, self.dp)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def mp_group(self):
        return self.groups.get("mp")

    @property
    def embedding_group(self):
        return self.groups.get("embedding")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the pipeline stage `pp_rank` in my pipeline (same dp and tp rank)."""
        return rank_of(pp_rank % self.pp, self.dp_rank, self.tp_rank, self.tp, self.dp)

    @property
    def next_rank(self) -> int:
        return self.stage_rank(self.pp_rank + 1)

    @property
    def prev_rank(self) -> int:
        return self.stage_rank(self.pp_rank - 1)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} pp={self.pp_rank}/{self.pp} "
                f"dp={self.dp_rank}/{self.dp} tp={self.tp_rank}/{self.tp} vpp={self.vpp} "
                f"device={self.device}")


# ---- process-group initialisation from torchrun's environment ----------------------------

def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise the default group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR...).

    A plain `python script.py` (no WORLD_SIZE) runs as a single process without a group.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1 and \
            "MASTER_ADDR" not in os.environ:
        return
    device = default_device()
    if device.type != "cpu":  # one accelerator per process, chosen by LOCAL_RANK
        torch.get_device_module(device).set_device(device)
    dist.init_process_group(backend=default_backend(),
                            timeout=datetime.timedelta(seconds=timeout_s))


def initialize(config: ParallelConfig, timeout_s: float = 600.0) -> ParallelTopology:
    """Validate the layout (before any group exists), init torch.distributed, build groups."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world)
    init_distributed(timeout_s)
    topo = ParallelTopology.from_config(config)
    logger.info("topology: %s", topo.describe())
    return topo
