"""The run journal: one JSON line per event (spikes, NaNs, rollbacks, skipped samples, hangs) and
one per logged iteration of metrics, in files next to the checkpoints that any tool can read.

A write that fails (a full disk) does not raise where it happens, on whichever rank or thread
wrote: the journal records the first failure (`failed`) and writes nothing more; the training
loop agrees on it across ranks and ends the run with one line (`LogWriteError`).
"""
from __future__ import annotations

import errno
import json
import os
import time

JOURNAL, METRICS = "journal.jsonl", "metrics.jsonl"


def _append(path: str, record: dict) -> None:
    # One write per line with O_APPEND: lines from several ranks never interleave.
    line = (json.dumps(record, default=float) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class LogWriteError(RuntimeError):
    """The run log could not be written. `here`: this rank's write failed (it says so); the
    other ranks stop with it silently."""

    def __init__(self, message: str, here: bool = True):
        super().__init__(message)
        self.here = here


def _reason(e: OSError) -> str:
    return "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash: the rest of the journal still counts
    return out


class RunJournal:
    def __init__(self, run_dir: str | None):
        self.dir = run_dir
        self.failed: str | None = None  # the first failed write's message; nothing written since
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)

    def _write(self, name: str, record: dict) -> None:
        if not self.dir or self.failed:
            return
        path = os.path.join(self.dir, name)
        try:
            _append(path, record)
        except OSError as e:
            self.failed = (f"{path}: {_reason(e)} while writing the run log; the run stops here "
                           f"and the last checkpoint is intact: free space, then resume with --load")

    def event(self, kind: str, **fields) -> None:
        self._write(JOURNAL, dict(kind=kind, time=time.time(), **fields))

    def metrics(self, iteration: int, prefix: str, values: dict) -> None:
        self._write(METRICS, dict(iteration=iteration, split=prefix, **values))

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.dir:
            return []
        return [e for e in read_jsonl(os.path.join(self.dir, JOURNAL)) if kind is None or e["kind"] == kind]

    def skipped_samples(self) -> list[tuple[int, int]]:
        """Physical sample ranges skipped by earlier rollbacks (kept on resume)."""
        return [tuple(r) for e in self.events("skip_samples") for r in e["ranges"]]
