"""Build index arrays once (rank 0), cache them as .npy under a config hash, mmap them everywhere.

Every rank calls ``build_or_load`` with the same arguments. Rank 0 builds on a cache miss and
writes each array atomically (temporary name, then rename), the description last, so a reader
never sees half a cache; the other ranks wait at a barrier, then all ranks memory-map the files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)


def config_hash(description: dict) -> str:
    """A stable digest of everything the indices depend on (sorted JSON, md5)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def world_collectives():
    """`parallel.collectives` and its world group, or None without torch (a project dependency,
    but data/ need not insist on it)."""
    try:
        from megazoo.parallel import collectives
    except ImportError:
        return None
    return collectives, collectives.world()


def is_first_rank(world) -> bool:
    """Whether this process is global rank 0 (or alone); `world` from `world_collectives()`."""
    return world is None or world[0].group_rank(world[1]) == 0


def barrier(world) -> None:
    if world is not None:
        world[0].barrier(world[1])


class CachedIndices:
    """Paths of one cache entry: ``<dir>/<hash>-<name>-<array>.npy`` plus a description file."""

    def __init__(self, cache_dir: str, name: str, description: dict, arrays: tuple[str, ...]) -> None:
        self.description = json.dumps(description, sort_keys=True, indent=1, default=str)
        base = os.path.join(cache_dir, f"{config_hash(description)}-{name}")
        self.description_path = base + "-description.json"
        self.paths = {a: f"{base}-{a}.npy" for a in arrays}
        self.built_anew = False

    def complete(self) -> bool:
        return os.path.isfile(self.description_path) and all(os.path.isfile(p) for p in self.paths.values())

    def build_or_load(self, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        world = world_collectives()
        if is_first_rank(world) and not self.complete():
            t0 = time.perf_counter()
            arrays = build()
            os.makedirs(os.path.dirname(self.description_path) or ".", exist_ok=True)
            for key, path in self.paths.items():
                tmp = f"{path}.{os.getpid()}.tmp.npy"
                np.save(tmp, arrays[key], allow_pickle=False)
                os.replace(tmp, path)
            tmp = f"{self.description_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(self.description)
            os.replace(tmp, self.description_path)
            self.built_anew = True
            logger.info("built %s in %.2f s", self.description_path, time.perf_counter() - t0)
        barrier(world)
        if not self.complete():
            raise FileNotFoundError(
                f"{self.description_path}: index cache missing after rank 0 built it; "
                "the cache directory must be shared by all ranks (set cache_dir to a shared path)"
            )
        return {key: np.load(path, mmap_mode="r", allow_pickle=False) for key, path in self.paths.items()}
