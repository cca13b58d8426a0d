"""A watchdog that turns a hung collective into an error naming the operation and the missing ranks.

Before a monitored collective every rank records its arrival in torch.distributed's key-value
store (the rendezvous store torchrun already runs) and arms a timer. Every rank walks the same
sequence of monitored collectives, so arrival keys line up by sequence number. If the collective
has not returned within the timeout, a background thread reads which ranks never arrived, logs
one error line (and hands it to `on_timeout`, e.g. the run journal) and ends the process: a
blocked gloo/NCCL call cannot be interrupted from Python, and torchrun then stops the others.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE = 3


class CollectiveWatchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int,
                 on_timeout: Callable[[str], None] | None = None, exit_process: bool = True):
        self.timeout, self.rank, self.world = timeout_s, rank, world_size
        self.on_timeout, self.exit_process = on_timeout, exit_process
        self.enabled = timeout_s > 0 and dist.is_initialized() and world_size > 1
        self.store = dist.distributed_c10d._get_default_store() if self.enabled else None
        self.seq = 0
        self._armed: tuple[int, str, list[int], float] | None = None
        self._lock = threading.Lock()
        self.fired: str | None = None
        if self.enabled:
            threading.Thread(target=self._watch, name="collective-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def collective(self, op: str, group: str = "world", ranks: list[int] | None = None):
        """Monitor the collective(s) in the body; `ranks` are the ranks expected to take part."""
        if not self.enabled:
            yield
            return
        self.seq += 1
        ranks = list(range(self.world)) if ranks is None else ranks
        self.store.set(f"watchdog/{self.seq}/{self.rank}", "1")
        with self._lock:
            self._armed = (self.seq, f"{op} over {group}", ranks, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._armed = None

    def _missing(self, seq: int, ranks: list[int]) -> list[int]:
        missing = []
        for r in ranks:
            try:
                self.store.wait([f"watchdog/{seq}/{r}"], _short())
            except Exception:  # noqa: BLE001 - the key never appeared: that rank did not arrive
                missing.append(r)
        return missing

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.2, self.timeout / 4))
            with self._lock:
                armed = self._armed
            if armed is None or time.monotonic() - armed[3] < self.timeout:
                continue
            seq, what, ranks, _ = armed
            missing = self._missing(seq, ranks)
            late = missing or "none (all arrived; a rank is stuck inside the collective)"
            self.fired = (f"collective {what} timed out after {self.timeout:g} s on rank {self.rank}: "
                          f"ranks that did not arrive: {late}")
            logger.error(self.fired)
            if self.on_timeout is not None:
                self.on_timeout(self.fired)
            if self.exit_process:
                logging.shutdown()
                os._exit(EXIT_CODE)
            return


def _short():
    import datetime
    return datetime.timedelta(milliseconds=200)
