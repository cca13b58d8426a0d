"""The run journal: one JSON line per event (spikes, NaNs, rollbacks, skipped samples, hangs) and
one per logged iteration of metrics, in files next to the checkpoints that any tool can read."""
from __future__ import annotations

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
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)

    def event(self, kind: str, **fields) -> None:
        if self.dir:
            _append(os.path.join(self.dir, JOURNAL), dict(kind=kind, time=time.time(), **fields))

    def metrics(self, iteration: int, prefix: str, values: dict) -> None:
        if self.dir:
            _append(os.path.join(self.dir, METRICS), dict(iteration=iteration, split=prefix, **values))

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.dir:
            return []
        return [e for e in read_jsonl(os.path.join(self.dir, JOURNAL)) if kind is None or e["kind"] == kind]

    def skipped_samples(self) -> list[tuple[int, int]]:
        """Physical sample ranges skipped by earlier rollbacks (kept on resume)."""
        return [tuple(r) for e in self.events("skip_samples") for r in e["ranges"]]
