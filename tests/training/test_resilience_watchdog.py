"""The collective watchdog on a counting store, in one process: store traffic at 4,096 ranks is
constant per rank and independent of the number of steps, and the verdicts (a live rank that did
not arrive, a frozen rank, a slow but alive rank in a patient phase) from the keys alone."""
from collections import Counter

from megazoo.training.resilience.watchdog import BEATS_PER_TIMEOUT, PATIENCE, CollectiveWatchdog


class CountingStore:
    """A dict with the store calls the watchdog makes, counting operations and requests."""

    def __init__(self):
        self.data, self.ops = {}, Counter()

    def set(self, key, value):
        self.ops["set"] += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.ops["get"] += 1
        return self.data[key]

    def check(self, keys):
        self.ops["check"] += 1
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        self.ops["multi_get"] += 1
        return [self.data[k] for k in keys]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _world(n, store, clock, timeout=300.0):
    return [CollectiveWatchdog(timeout, r, n, store=store, start_threads=False, clock=clock,
                               exit_process=False) for r in range(n)]


def _steps(world, clock, steps, step_s):
    """Every rank walks the step's three monitored collectives; each beats when its thread would."""
    for _ in range(steps):
        for wd in world:
            for op in ("pipeline forward/backward", "all_reduce(loss)", "optimizer step"):
                with wd.collective(op):
                    pass
        before, clock.t = clock.t, clock.t + step_s
        beats = int(clock.t // world[0].beat_s) - int(before // world[0].beat_s)
        for wd in world:
            for _ in range(beats):
                wd.beat()


def test_store_traffic_at_4096_ranks_is_constant_per_rank():
    n, step_s = 4096, 10.0
    store, clock = CountingStore(), Clock()
    world = _world(n, store, clock)
    assert store.ops == {"set": n} and len(store.data) == n  # one key per rank, written at start
    _steps(world, clock, 2, step_s)
    keys_2, sets_2 = len(store.data), store.ops["set"]
    _steps(world, clock, 2, step_s)
    assert len(store.data) == keys_2 == n  # no key per collective, per step or per beat
    assert set(store.ops) == {"set"}  # entering and leaving collectives costs nothing
    # 4 steps of 10 s = 40 s: one beat per rank each timeout / 8 = 37.5 s
    assert sets_2 == n and store.ops["set"] == 2 * n
    assert world[0].beat_s == 300.0 / BEATS_PER_TIMEOUT


def test_hang_verdict_reads_the_store_in_four_requests_and_names_the_rank():
    n = 4096
    store, clock = CountingStore(), Clock()
    world = _world(n, store, clock, timeout=8.0)
    late = 4000  # does not arrive (alive: it keeps beating); 17 freezes inside the collective
    contexts = {r: world[r].collective("all_reduce(loss)") for r in range(n) if r != late}
    for c in contexts.values():
        c.__enter__()
    snapshot, store.ops = None, Counter()
    for t in range(1, 10):  # seconds
        clock.t = float(t)
        if t in (1, 4, 8):  # beats of the live ranks (17 beats once, then freezes)
            for r, wd in enumerate(world):
                if r != 17 or t == 1:
                    wd.beat()
        beats = store.ops["set"]
        snapshot = world[0].check(snapshot)
        if isinstance(snapshot, str):
            break
    assert isinstance(snapshot, str) and clock.t == 8.0
    assert store.ops["multi_get"] == 2 and store.ops["check"] == 2 and store.ops["get"] == 0
    assert beats == 3 * n - 2
    later = None  # rank 1 reads no key up to the timeout (one rank in 64 judges first) ...
    for t in (4.0, 6.0, 8.0):
        clock.t = t
        later = world[1].check(later)
    assert later is None and store.ops["multi_get"] == 2
    for t in (12.0, 16.0):  # ... and judges at twice the timeout if the job is still up
        clock.t = t
        for r, wd in enumerate(world):
            if r != 17:
                wd.beat()
        later = world[1].check(later)
    assert store.ops["multi_get"] == 4
    assert later.startswith("collective all_reduce(loss) over world timed out after 16 s on rank 1: "
                            "ranks that did not arrive: [4000]; frozen ranks (no heartbeat for 4 s): "
                            "[17] "), later
    assert snapshot.startswith("collective all_reduce(loss) over world timed out after 8 s on rank 0: "
                               "ranks that did not arrive: [4000]; frozen ranks (no heartbeat for 4 s): "
                               "[17] (rank 17: iteration 0, all_reduce(loss) over world)"), snapshot


def _run_patient(frozen_rank=None, ends_at=None):
    """Rank 1 works inside a patient phase (a save) that rank 0 waits in; returns rank 0's
    verdict and when it came (None: still waiting at `ends_at`)."""
    store, clock = CountingStore(), Clock()
    world = _world(3, store, clock, timeout=4.0)
    waiting = [world[r].collective("checkpoint save", patient=True) for r in (0, 2)]
    for c in waiting:  # (kept referenced: a collected context manager leaves its collective)
        c.__enter__()
    snapshot = None
    for step in range(1, int(ends_at * 2) + 1):
        clock.t = step / 2
        for r, wd in enumerate(world):
            if r != frozen_rank:
                wd.beat()
        snapshot = world[0].check(snapshot)
        if isinstance(snapshot, str):
            return snapshot, clock.t
    return None, clock.t


def test_patient_phase_waits_for_a_live_rank_and_names_a_frozen_one():
    verdict, at = _run_patient(ends_at=PATIENCE * 4.0 - 0.5)
    assert verdict is None  # rank 1 is alive and still writing: waited for
    verdict, at = _run_patient(ends_at=PATIENCE * 4.0 + 1)
    assert at == PATIENCE * 4.0 and "ranks that did not arrive: [1]" in verdict, verdict
    verdict, at = _run_patient(frozen_rank=1, ends_at=30)
    assert at == 4.0, at
    assert verdict == ("collective checkpoint save over world timed out after 4 s (a patient phase) "
                       "on rank 0: ranks that did not arrive: none (every live rank arrived); frozen "
                       "ranks (no heartbeat for 2 s): [1] (rank 1: iteration 0, computing)"), verdict
