"""A watchdog that turns a hung collective into an error naming the operation and the guilty ranks.

Before a monitored collective every rank records its arrival in torch.distributed's key-value
store (the rendezvous store torchrun already runs) and arms a timer. Every rank walks the same
sequence of monitored collectives, so arrival keys line up by sequence number. Every rank also
beats a heartbeat in the store (a counter with its iteration and phase) from a background thread,
so a rank that is frozen (SIGSTOP, a stuck driver, swapped out) stops beating even when it froze
*inside* a collective that every rank reached. If a collective has not returned within the
timeout, a background thread names the ranks that never arrived and the ranks whose heartbeat
stood still over the second half of the wait (with their last iteration and phase), logs one
error line (and hands it to `on_timeout`, e.g. the run journal) and ends the process: a blocked
gloo/NCCL call cannot be interrupted from Python, and torchrun then stops the others.

On by default (`--collective-timeout`, 5 minutes); torch's own watchdog is armed too: the process
group's timeout is set past ours (so our message comes first), and on NCCL the flight recorder
and dump-on-timeout are switched on unless the environment already chooses. With a store hosted
inside rank 0 (no torchrun agent), a frozen rank 0 also freezes the store: use torchrun.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE = 3
DEFAULT_TIMEOUT_S = 300.0
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # torch's watchdog aborts a hung communicator
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder: the last collectives per rank
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # ... written out when torch's watchdog fires


def backend_timeout(timeout_s: float) -> float:
    """The process group's own timeout: past the watchdog's, so the named error comes first;
    also arms NCCL's watchdog and flight recorder (environment defaults, before the group)."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    return max(600.0, 2 * timeout_s) if timeout_s > 0 else 600.0


class CollectiveWatchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int,
                 on_timeout: Callable[[str], None] | None = None, exit_process: bool = True):
        self.timeout, self.rank, self.world = timeout_s, rank, world_size
        self.on_timeout, self.exit_process = on_timeout, exit_process
        self.enabled = timeout_s > 0 and dist.is_initialized() and world_size > 1
        self.store = dist.distributed_c10d._get_default_store() if self.enabled else None
        self.beat_s = min(1.0, timeout_s / 10)
        self.seq, self.iteration, self._beats = 0, 0, itertools.count()
        self._armed: tuple[int, str, list[int], float] | None = None
        self._lock = threading.Lock()
        self.fired: str | None = None
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._watch, name="collective-watchdog", daemon=True).start()
            threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def close(self) -> None:
        """Stop watching and beating (the run is over; a later run in this process has its own)."""
        self._stop.set()

    def at_iteration(self, iteration: int) -> None:
        """The iteration this rank is working on (reported with its heartbeat)."""
        self.iteration = iteration

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
        self._beat_now()  # the phase is current even when steps are shorter than a beat
        try:
            yield
        finally:
            with self._lock:
                self._armed = None

    def _beat_now(self) -> None:
        with self._lock:
            phase = self._armed[1] if self._armed else "computing"
        self.store.set(f"heartbeat/{self.rank}", f"{next(self._beats)}|{self.iteration}|{phase}")

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat_now()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            self._stop.wait(self.beat_s)

    def _heartbeats(self) -> dict[int, str | None]:
        beats = {}
        for r in range(self.world):
            try:
                key = f"heartbeat/{r}"
                beats[r] = self.store.get(key).decode() if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - unreadable: treated as no heartbeat
                beats[r] = None
        return beats

    def _missing(self, seq: int, ranks: list[int]) -> list[int]:
        missing = []
        for r in ranks:
            try:
                self.store.wait([f"watchdog/{seq}/{r}"], datetime.timedelta(milliseconds=200))
            except Exception:  # noqa: BLE001 - the key never appeared: that rank did not arrive
                missing.append(r)
        return missing

    def _watch(self) -> None:
        snapshot = None  # heartbeats at half the timeout of the collective now armed
        while not self._stop.wait(min(0.2, self.timeout / 4)):
            with self._lock:
                armed = self._armed
            waited = time.monotonic() - armed[3] if armed else 0.0
            if armed is None or waited < self.timeout / 2:
                snapshot = None
                continue
            if snapshot is None or snapshot[0] != armed[0]:
                snapshot = (armed[0], self._heartbeats())
                continue
            if waited < self.timeout:
                continue
            seq, what, ranks, _ = armed
            self.fired = self._verdict(what, self._missing(seq, ranks), snapshot[1])
            logger.error(self.fired)
            if self.on_timeout is not None:
                self.on_timeout(self.fired)
            if self.exit_process:
                logging.shutdown()
                os._exit(EXIT_CODE)
            return

    def _verdict(self, what: str, missing: list[int], before: dict[int, str | None]) -> str:
        now = self._heartbeats()
        frozen = [r for r in range(self.world) if r != self.rank and now[r] == before[r]]
        late = missing or "none (all arrived)"
        text = (f"collective {what} timed out after {self.timeout:g} s on rank {self.rank}: "
                f"ranks that did not arrive: {late}")
        if frozen:
            last = "; ".join(f"rank {r}: " + (f"iteration {now[r].split('|')[1]}, "
                                              f"{now[r].split('|', 2)[2]}" if now[r] else
                                              "never beat") for r in frozen)
            return text + (f"; frozen ranks (no heartbeat for {self.timeout / 2:g} s): {frozen} "
                           f"({last})")
        if not missing:
            return text + "; every rank is alive: one is stuck inside the collective (a deadlock or " \
                          "a mismatched collective)"
        return text
