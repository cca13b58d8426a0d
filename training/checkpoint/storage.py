"""Checkpoint storage: free space before a save, retention (--keep-last, --keep-every) and an
exclusive lock on the --save folder, so that two jobs never interleave their checkpoints.

The lock is an `fcntl.flock` on `<save>/.lock` held by rank 0 for the whole run; the kernel drops
it when the process ends (even by kill -9), so a crashed job never leaves a stale lock. The file
names the holder (host, pid, start time) for the refusal message of a second job.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import socket
import time

logger = logging.getLogger(__name__)

LOCK = ".lock"
MARGIN = 1.05  # headroom over the estimated checkpoint size (metadata, file system blocks)


class SaveLockError(RuntimeError):
    """The --save folder is held by another job; the message names it."""


def folder_bytes(folder: str) -> int:
    total = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def free_space_problem(root: str, own_bytes: int, world_size: int,
                       previous: str | None) -> str | None:
    """None when `root` has room for one more checkpoint, else a one-line explanation.

    The size needed is the previous checkpoint's when there is one (what the same job wrote
    there last time), else this rank's tensors times the number of ranks."""
    probe = root
    while not os.path.isdir(probe):
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == os.path.abspath(probe):
            break
        probe = parent
    need = folder_bytes(previous) if previous else own_bytes * world_size
    free = shutil.disk_usage(probe).free
    if free >= need * MARGIN:
        return None
    return (f"--save {root}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
            f"{need * MARGIN / 2**30:.2f} GiB; free space there, give --save another disk, or pass "
            f"--keep-last N (a save that lacks room then first deletes the checkpoints beyond the "
            f"newest N-1; the newest is always kept)")


def make_room(root: str, folders: list[str], own_bytes: int, world_size: int,
              keep_last: int | None, keep_every: int | None) -> list[str]:
    """Before a save that lacks room: delete now the checkpoints that `prune` would delete
    after it (beyond the newest keep_last - 1), never the newest one, so the save can fit.
    Returns the deleted folders (none when there is room or no --keep-last)."""
    if not keep_last or not folders or \
            free_space_problem(root, own_bytes, world_size, folders[0]) is None:
        return []
    deleted = prune(folders, max(keep_last - 1, 1), keep_every)
    if deleted:
        logger.warning("--save %s lacks room for the next checkpoint: deleted %d older one(s) "
                       "before saving (--keep-last %d would delete them after it)", root,
                       len(deleted), keep_last)
    return deleted


def prune(folders: list[str], keep_last: int | None, keep_every: int | None) -> list[str]:
    """Delete checkpoints beyond the newest `keep_last` (folders newest first, the one `latest`
    names first), except every `keep_every`-th iteration. Returns the deleted folders."""
    if not keep_last:
        return []
    deleted = []
    for folder in folders[keep_last:]:
        m = re.match(r"iter_(\d+)", os.path.basename(folder))
        if m and keep_every and int(m[1]) % keep_every == 0:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        deleted.append(folder)
    if deleted:
        logger.info("--keep-last %d: deleted %s", keep_last, ", ".join(map(os.path.basename, deleted)))
    return deleted


class SaveLock:
    """Exclusive ownership of a --save folder for one job (rank 0 takes it; `release` ends it)."""

    def __init__(self, root: str):
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, LOCK)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            raise SaveLockError(f"--save {root} is in use by another job ({holder}; lock file "
                                f"{self.path}); give this job another --save folder or stop "
                                f"that job first") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (f"host {socket.gethostname()} pid {os.getpid()} since "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n").encode(), 0)

    def release(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    __del__ = release  # a run that failed before its `finally` still lets go
