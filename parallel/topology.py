"""Process topology: this rank's coordinates and its process groups.

The layout rules, the rank order and the group lists live in `parallel/layout.py`; this file
turns them into process groups. A `ParallelTopology` is an explicit object handed to every layer, schedule and optimizer that
needs to communicate; nothing reads a global. Every group of size 1 (all of them at world size 1)
is `collectives.SINGLE`, over which every collective is the identity, so the same model code runs
unsharded.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collectives import SINGLE, world
from .layout import Coords, Grid, LayoutError, ParallelConfig  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)


@dataclass
class ParallelTopology:
    """This rank's coordinates and process groups. Groups of size 1 are `collectives.SINGLE`."""

    config: ParallelConfig
    rank: int = 0
    world_size: int = 1
    dp: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # kind -> ProcessGroup (absent: SINGLE)
    group_ranks: dict = field(default_factory=dict)  # kind -> list of global ranks in my group

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def single(cls, config: ParallelConfig | None = None, device: torch.device | str = "cpu"):
        """The unsharded topology: one process, no groups. Used by references and tools."""
        config = config or ParallelConfig()
        if config.tp * config.pp * config.cp * config.ep != 1:
            raise LayoutError("a single-process topology needs tp = pp = cp = ep = 1")
        return cls(config=config, device=torch.device(device), group_ranks=Grid().groups_of(0))

    @classmethod
    def from_config(cls, config: ParallelConfig) -> "ParallelTopology":
        """Build from an initialised default process group (see `init_distributed`)."""
        if not dist.is_available() or not dist.is_initialized():
            return cls.single(config)
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = config.validate(world)
        topo = cls(config=config, rank=rank, world_size=world, dp=dp, device=default_device())
        # Every rank must create every group, in the same order, even those it is not in. Kinds
        # that coincide (dp_cp is dp when cp = 1) share one process group.
        made: dict[tuple[int, ...], object] = {}
        for kind, lists in topo.grid.groups().items():
            for ranks in lists:
                if len(ranks) > 1 and tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks)
                if rank in ranks:
                    if tuple(ranks) in made:
                        topo.groups[kind] = made[tuple(ranks)]
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
    def cp(self) -> int:
        return self.config.cp

    @property
    def ep(self) -> int:
        return self.config.ep

    @property
    def grid(self) -> Grid:
        return Grid(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep)

    @property
    def coords(self) -> Coords:
        return self.grid.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def tp_group(self):
        return self.groups.get("tp", SINGLE)

    @property
    def dp_group(self):
        return self.groups.get("dp", SINGLE)

    @property
    def cp_group(self):
        return self.groups.get("cp", SINGLE)

    @property
    def dp_cp_group(self):
        """Data x context parallel: replicated parameters' gradients are reduced over it."""
        return self.groups.get("dp_cp", SINGLE)

    @property
    def ep_group(self):
        return self.groups.get("ep", SINGLE)

    @property
    def edp_group(self):
        """Expert data parallel: the ranks holding the same experts."""
        return self.groups.get("edp", SINGLE)

    @property
    def pp_group(self):
        return self.groups.get("pp", SINGLE)

    @property
    def mp_group(self):
        return self.groups.get("mp", SINGLE)

    @property
    def embedding_group(self):
        return self.groups.get("embedding", SINGLE)

    @property
    def world_group(self):
        """Every rank: the default group, or `SINGLE` in a one-process run (or a topology built
        offline, without process groups, to lay out another world's chunks)."""
        return world() if self.world_size > 1 else SINGLE

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the pipeline stage `pp_rank` in my pipeline (same dp and tp rank)."""
        c = self.coords
        return self.grid.rank(pp_rank % self.pp, c.dp, c.cp, c.tp)

    @property
    def next_rank(self) -> int:
        return self.stage_rank(self.pp_rank + 1)

    @property
    def prev_rank(self) -> int:
        return self.stage_rank(self.pp_rank - 1)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} pp={self.pp_rank}/{self.pp} "
                f"dp={self.dp_rank}/{self.dp} cp={self.cp_rank}/{self.cp} tp={self.tp_rank}/{self.tp} "
                f"ep={self.ep} vpp={self.vpp} "
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
