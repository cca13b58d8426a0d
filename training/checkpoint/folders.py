"""Which folder of a --save root is a checkpoint: the names (`iter_N/`, `rank_NNNNN.safetensors`),
the `latest` pointer, and the complete folders a resume tries, newest first (`candidates`); the
layout itself is described in training/checkpoint/format.py, which re-exports these names."""
from __future__ import annotations

import logging
import os
import re

from megazoo.training.checkpoint.errors import CheckpointError

# the name these warnings carried before they moved here from format.py
logger = logging.getLogger("megazoo.training.checkpoint.format")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank:05d}.safetensors")


def _shown(name: str | None) -> str:
    """A pointer's content for a message: garbage bytes are counted, not printed."""
    if name and name.isprintable() and len(name) <= 80:
        return repr(name)
    return f"{len(name or '')} characters that are no folder name"


def read_pointer(root: str) -> str | None:
    """The folder name `latest` holds (garbage bytes read as text: they name no folder)."""
    try:
        with open(os.path.join(root, "latest"), encoding="utf-8", errors="replace") as f:
            return f.read(256).strip() or None
    except OSError:
        return None


_FOLDER = re.compile(r"iter_(\d+)(\.tmp|\.old)?")


def candidates(root: str) -> list[str]:
    """Complete checkpoint folders under a --save root, the one to resume from first.

    Normally: the folder `latest` names, then the older complete ones, newest first (the
    fallbacks when one fails verification). When `latest` names a missing folder (a crash at
    the wrong moment, a folder deleted by hand), every complete folder, newest first: a
    `.tmp` folder holding meta.json was complete before its rename, an `.old` one before its
    replacement."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _FOLDER.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            found.append((int(m[1]), {None: 2, ".tmp": 1, ".old": 0}[m[2]], name))
    found.sort(reverse=True)
    named = read_pointer(root)
    by_name = {name: (it, pref) for it, pref, name in found}
    if named in by_name:
        it = by_name[named][0]
        return [os.path.join(root, named)] + [os.path.join(root, n) for i, _, n in found
                                               if i < it]
    if named is not None and found:
        logger.warning("%s names %s, which is missing or incomplete; using the newest complete "
                       "checkpoint, %s", os.path.join(root, "latest"), _shown(named), found[0][2])
    if named is None and found:
        logger.warning("%s has no 'latest' pointer; using the newest complete checkpoint, %s",
                       root, found[0][2])
    return [os.path.join(root, n) for _, _, n in found]


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint a resume starts from (see `candidates`); None when the root has none."""
    pointer = os.path.join(root, "latest")
    folders = candidates(root)
    if folders:
        return folders[0]
    if os.path.exists(pointer):
        raise CheckpointError(f"{pointer} names {_shown(read_pointer(root))}, which does not exist, and no "
                              f"complete iter_* folder is left; point it at a complete checkpoint")
    return None


def resolve(path: str) -> str:
    """A checkpoint folder from a --save/--load root (through `latest`) or an iter_* folder."""
    folder = path if os.path.isfile(os.path.join(path, "meta.json")) else latest_checkpoint(path)
    if folder is None or not os.path.isfile(os.path.join(folder, "meta.json")):
        raise CheckpointError(f"{path}: no checkpoint here ('latest' or meta.json); pass the "
                              f"--save folder of a training run or of tools/convert_hf.py import")
    return folder
