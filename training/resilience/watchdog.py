"""A watchdog that turns a hung collective phase into an error naming the operation and the guilty ranks.

Every rank owns one key in torch.distributed's key-value store (the rendezvous store torchrun
already runs): `watchdog/<rank>`, rewritten by a background thread every timeout / 8 seconds
with a beat counter, the sequence number of the last monitored collective this rank reached,
its iteration and its phase. Heartbeat and arrival travel in that one write, so the store holds
`world` keys whatever the run's length, and entering or leaving a monitored collective costs no
store operation at all (a rank waiting inside a collective is alive, and its next beat says so).

If a collective has not returned within the timeout, a background thread reads every rank's key
twice, half a timeout apart (one request each: `multi_get`; one rank in 64 reads at the
timeout, the others at twice the timeout if the job is still up), and names the live ranks that never
arrived and the ranks whose beat stood still (frozen: SIGSTOP, a stuck driver, swapped out) with
their last iteration and phase; it logs one error line (and hands it to `on_timeout`, e.g. the
run journal) and ends the process: a blocked gloo/NCCL call cannot be interrupted from Python,
and torchrun then stops the others. A *patient* phase (a checkpoint save, a data-index build:
one rank legitimately works while the others wait) fires at the timeout only for a frozen rank
or a deadlock; live ranks still working are waited for (a warning every half timeout), up to
PATIENCE timeouts.

Store traffic per rank: 8 writes per timeout (at 300 s: one per 37.5 s) and one per patient
phase, nothing per step; at a timeout, 2 reads of all keys by one rank in 64. (So a frozen rank's last iteration
and phase can be up to timeout / 8 old, except in a patient phase.) Figures for 4,096 ranks: docs/architecture.md.

On by default (`--collective-timeout`, 5 minutes); torch's own watchdog is armed too: the process
group's timeout is set past ours (so our message comes first), and on NCCL the flight recorder
and dump-on-timeout are switched on unless the environment already chooses. With a store hosted
inside rank 0 (no torchrun agent), a frozen rank 0 also freezes the store: use torchrun.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE = 3
DEFAULT_TIMEOUT_S = 300.0
BEATS_PER_TIMEOUT = 8  # a live rank beats >= 3 times in the half timeout that tells frozen from alive
PATIENCE = 4  # timeouts a patient phase waits for live ranks that are still working
READER_STRIDE = 64  # ranks 0, 64, 128, ... judge at the timeout; the others at twice the timeout
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # torch's watchdog aborts a hung communicator
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder: the last collectives per rank
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # ... written out when torch's watchdog fires


def backend_timeout(timeout_s: float) -> float:
    """The process group's own timeout: past the watchdog's (and a patient phase's), so the named
    error comes first; also arms NCCL's watchdog and flight recorder (environment defaults)."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    return max(600.0, (PATIENCE + 1) * timeout_s) if timeout_s > 0 else 600.0


def heartbeat_key(rank: int) -> str:
    return f"watchdog/{rank}"


class Beat(NamedTuple):
    """One rank's key: its beat counter, last monitored collective reached, iteration, phase."""
    count: int
    seq: int
    iteration: int
    phase: str

    def encode(self) -> str:
        return f"{self.count}|{self.seq}|{self.iteration}|{self.phase}"

    @staticmethod
    def decode(raw: bytes | str | None) -> "Beat | None":
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        count, seq, iteration, phase = text.split("|", 3)
        return Beat(int(count), int(seq), int(iteration), phase)


@dataclass(frozen=True)
class Armed:
    seq: int
    what: str
    ranks: list[int] | None  # None: the whole world
    start: float
    patient: bool


def read_heartbeats(store, world: int) -> dict[int, Beat | None]:
    """Every rank's key in one request (a rank that never beat: None)."""
    keys = [heartbeat_key(r) for r in range(world)]
    try:
        if store.check(keys):  # multi_get would block on a missing key
            return {r: Beat.decode(v) for r, v in enumerate(store.multi_get(keys))}
    except Exception as e:  # noqa: BLE001 - a store without multi_get, or one going away
        logger.info("reading the watchdog's keys one by one (%s)", e)
    beats = {}
    for r, key in enumerate(keys):
        try:
            beats[r] = Beat.decode(store.get(key)) if store.check([key]) else None
        except Exception:  # noqa: BLE001 - unreadable: treated as no heartbeat
            beats[r] = None
    return beats


class CollectiveWatchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int,
                 on_timeout: Callable[[str], None] | None = None, exit_process: bool = True,
                 store=None, start_threads: bool = True, clock: Callable[[], float] = time.monotonic):
        """`store`: the key-value store (default: torch.distributed's); `start_threads=False` and
        `clock` let a single process drive many ranks (the store-traffic dry run)."""
        self.timeout, self.rank, self.world = timeout_s, rank, world_size
        self.on_timeout, self.exit_process, self.clock = on_timeout, exit_process, clock
        self.enabled = timeout_s > 0 and world_size > 1 and (store is not None or dist.is_initialized())
        self.store = (store or dist.distributed_c10d._get_default_store()) if self.enabled else None
        self.beat_s = timeout_s / BEATS_PER_TIMEOUT
        # At a hang every waiting rank would read all keys at once (world^2 values on one store):
        # one rank in READER_STRIDE judges first; the others only if the job is still up later.
        self.deadline = timeout_s * (1.0 if rank % READER_STRIDE == 0 else 2.0)
        self.seq, self.iteration, self._count = 0, 0, 0
        self._armed: Armed | None = None
        self._lock = threading.Lock()
        self.fired: str | None = None
        self._stop = threading.Event()
        if self.enabled:
            self.beat()  # the key exists before any rank can wait on this one
            if start_threads:
                threading.Thread(target=self._watch, name="collective-watchdog", daemon=True).start()
                threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True).start()

    def close(self) -> None:
        """Stop watching and beating (the run is over; a later run in this process reuses the key)."""
        self._stop.set()

    def at_iteration(self, iteration: int) -> None:
        """The iteration this rank is working on (reported with its heartbeat)."""
        self.iteration = iteration

    @contextlib.contextmanager
    def collective(self, op: str, group: str = "world", ranks: list[int] | None = None,
                   patient: bool = False):
        """Monitor the collective(s) in the body; `ranks` are the ranks expected to take part.
        `patient`: ranks may legitimately work for long inside (see the module's docstring)."""
        if not self.enabled:
            yield
            return
        with self._lock:
            self.seq += 1
            self._armed = Armed(self.seq, f"{op} over {group}", ranks, self.clock(), patient)
        if patient:  # rare phases (saves, index builds): a rank frozen inside is named with it
            self.beat()
        try:
            yield
        finally:
            with self._lock:
                self._armed = None

    def beat(self) -> None:
        """Write this rank's key: one store operation."""
        with self._lock:
            self._count += 1
            phase = self._armed.what if self._armed else "computing"
            beat = Beat(self._count, self.seq, self.iteration, phase)
        self.store.set(heartbeat_key(self.rank), beat.encode())

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    def _watch(self) -> None:
        snapshot = None  # (seq, heartbeats, waited) half a timeout before a verdict
        while not self._stop.wait(min(0.2, self.timeout / 4)):
            verdict = self.check(snapshot)
            if isinstance(verdict, str):
                self._fire(verdict)
                return
            snapshot = verdict

    def check(self, snapshot):
        """One look at the collective armed now: the next snapshot (None: nothing to watch), or
        the error line when it has timed out."""
        with self._lock:
            armed = self._armed
        if armed is None:
            return None
        waited = self.clock() - armed.start
        if snapshot is None or snapshot[0] != armed.seq:
            return (armed.seq, read_heartbeats(self.store, self.world), waited) \
                if waited >= self.deadline - self.timeout / 2 else None
        if waited < self.deadline or waited - snapshot[2] < self.timeout / 2:
            return snapshot
        now = read_heartbeats(self.store, self.world)
        frozen = [r for r in range(self.world) if r != self.rank and now[r] == snapshot[1][r]]
        expected = range(self.world) if armed.ranks is None else armed.ranks
        missing = [r for r in expected if r != self.rank and r not in frozen
                   and (now[r] is None or now[r].seq < armed.seq)]
        if armed.patient and missing and not frozen and waited < PATIENCE * self.timeout:
            logger.warning("%s: waited %.0f s on rank %d for ranks %s, alive and still working; "
                           "waiting up to %g s", armed.what, waited, self.rank, missing,
                           PATIENCE * self.timeout)
            return (armed.seq, now, waited)
        return self.verdict(armed, waited, missing, frozen, now)

    def verdict(self, armed: Armed, waited: float, missing: list[int], frozen: list[int],
                now: dict[int, Beat | None]) -> str:
        late = missing or "none (every live rank arrived)"
        after = f"{waited:.0f} s (a patient phase)" if armed.patient else f"{self.deadline:g} s"
        text = (f"collective {armed.what} timed out after {after} on rank {self.rank}: "
                f"ranks that did not arrive: {late}")
        if frozen:
            last = "; ".join(f"rank {r}: " + (f"iteration {now[r].iteration}, {now[r].phase}"
                                              if now[r] else "never beat") for r in frozen)
            return text + (f"; frozen ranks (no heartbeat for {self.timeout / 2:g} s): {frozen} "
                           f"({last})")
        if not missing:
            return text + "; every rank is alive: one is stuck inside the collective (a deadlock or " \
                          "a mismatched collective)"
        return text

    def _fire(self, message: str) -> None:
        self.fired = message
        logger.error(message)
        if self.on_timeout is not None:
            self.on_timeout(message)
        if self.exit_process:
            logging.shutdown()
            os._exit(EXIT_CODE)
