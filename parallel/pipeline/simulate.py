"""Run every rank's step list in pure Python: matching, deadlock, dependencies, memory, timing.

The model of communication is deliberately the strictest one the engine can meet:

* each run of consecutive Comm steps is posted as one batch (exactly `comm_batches`), and the
  rank waits until *every* op of the batch has completed before its next step;
* a send completes only when the peer has posted the matching receive (rendezvous; no eager
  buffering), so a schedule that passes here cannot deadlock on a backend that buffers more;
* messages between one ordered pair of ranks match in posting order (tags are not used, since
  NCCL ignores them), and the k-th send must carry what the k-th receive expects: same kind,
  same microbatch, same destination virtual stage.

With durations for forward and backward (communication is free) the same walk yields the
schedule's makespan and a per-rank timeline, which the bubble benchmark compares with measurement.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from megazoo.parallel.pipeline.schedules import (RECVS, Backward, Comm, Compute, Forward, RecvActivation,
                                         SendActivation, SendGrad, Step, comm_batches)


class ScheduleError(AssertionError):
    """A schedule that would hang, mismatch messages or compute out of order."""


@dataclass
class SimResult:
    peak_activations: list[int]  # per rank: most (mb, chunk) forwarded but not yet backwarded
    makespan: float
    events: list[list[tuple[str, int, int, float, float]]] = field(default_factory=list)
    # events[rank] = [(kind "F"/"B", mb, chunk, start, end), ...]

    def bubble_fraction(self) -> float:
        busy = sum(e[4] - e[3] for evs in self.events for e in evs)
        return 1.0 - busy / (len(self.events) * self.makespan) if self.makespan else 0.0


def _message(step: Comm, src: int, pp: int) -> tuple[str, int, int]:
    """What a comm step carries, named by destination virtual stage (comparable at both ends)."""
    stage = step.chunk * pp + src
    if isinstance(step, SendActivation):
        return ("act", step.mb, stage + 1)
    if isinstance(step, RecvActivation):
        return ("act", step.mb, stage)
    if isinstance(step, SendGrad):
        return ("grad", step.mb, stage - 1)  # the gradient of my input, for the previous stage
    return ("grad", step.mb, stage)  # RecvGrad: the gradient of my own output


def simulate(schedules: list[list[Step]], vpp: int = 1, forward_time: float = 1.0,
             backward_time: float = 2.0) -> SimResult:
    """Execute all ranks' lists together; raise ScheduleError on any defect."""
    pp = len(schedules)
    units = [comm_batches(s) for s in schedules]
    # Evaluation schedules have no backwards and keep nothing alive.
    forward_only = not any(isinstance(s, Backward) for steps in schedules for s in steps)
    pc = [0] * pp  # index of the next unit per rank
    clock = [0.0] * pp
    posted = [False] * pp  # is the batch at pc[r] already posted?
    # Per ordered pair (src, dst): queues of (message, post_time, (rank, batch_id, op_id)).
    sends: dict[tuple[int, int], deque] = defaultdict(deque)
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)
    done_at: dict[tuple[int, int, int], float] = {}  # (rank, unit, op) -> completion time
    have_input: set = set()  # (rank, mb, chunk) activations received
    have_grad: set = set()
    forwarded: dict[tuple[int, int, int], bool] = {}
    live = [0] * pp
    peak = [0] * pp
    events: list[list] = [[] for _ in range(pp)]

    def post(r: int) -> None:
        for i, op in enumerate(units[r][pc[r]]):
            if op.peer == r:
                raise ScheduleError(f"rank {r} sends to itself: {op}")
            pair = (r, op.peer) if not isinstance(op, RECVS) else (op.peer, r)
            queue = recvs if isinstance(op, RECVS) else sends
            queue[pair].append((_message(op, r, pp), clock[r], (r, pc[r], i)))
        posted[r] = True
        # Match every pair touched, in order.
        for pair in list(sends):
            while sends[pair] and recvs[pair]:
                (m_s, t_s, id_s), (m_r, t_r, id_r) = sends[pair].popleft(), recvs[pair].popleft()
                if m_s != m_r:
                    raise ScheduleError(f"ranks {pair}: send of {m_s} meets receive of {m_r}")
                done_at[id_s] = done_at[id_r] = max(t_s, t_r)

    def compute(r: int, op: Compute) -> None:
        key = (r, op.mb, op.chunk)
        stage = op.chunk * pp + r
        if isinstance(op, Forward):
            if key in forwarded:
                raise ScheduleError(f"rank {r} runs {op} twice")
            if stage > 0 and key not in have_input:
                raise ScheduleError(f"rank {r} runs {op} before receiving its input")
            forwarded[key] = forward_only
            live[r] += 0 if forward_only else 1
            peak[r] = max(peak[r], live[r])
            duration, kind = forward_time, "F"
        else:
            if forwarded.get(key) is not False:
                raise ScheduleError(f"rank {r} runs {op} without a pending forward")
            if stage < pp * vpp - 1 and key not in have_grad:
                raise ScheduleError(f"rank {r} runs {op} before receiving its output gradient")
            forwarded[key] = True
            live[r] -= 1
            duration, kind = backward_time, "B"
        events[r].append((kind, op.mb, op.chunk, clock[r], clock[r] + duration))
        clock[r] += duration

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(units[r]):
                unit = units[r][pc[r]]
                if isinstance(unit, Compute):
                    compute(r, unit)
                else:
                    if not posted[r]:
                        post(r)
                    ids = [(r, pc[r], i) for i in range(len(unit))]
                    if not all(i in done_at for i in ids):
                        break  # blocked on this batch; try other ranks
                    clock[r] = max([clock[r]] + [done_at[i] for i in ids])
                    for op in unit:
                        if isinstance(op, RecvActivation):
                            have_input.add((r, op.mb, op.chunk))
                        elif isinstance(op, RECVS):
                            have_grad.add((r, op.mb, op.chunk))
                    posted[r] = False
                pc[r] += 1
                progress = True

    stuck = {r: units[r][pc[r]] for r in range(pp) if pc[r] < len(units[r])}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait on {stuck}")
    leftover = {p: list(q) for p, q in list(sends.items()) + list(recvs.items()) if q}
    if leftover:
        raise ScheduleError(f"unmatched messages: {leftover}")
    missing = [k for k, done in forwarded.items() if not done]
    if missing:
        raise ScheduleError(f"forwards never backwarded: {missing}")
    return SimResult(peak_activations=peak, makespan=max(clock), events=events)


def check_complete(schedules: list[list[Step]], vpp: int, num_microbatches: int) -> None:
    """Every rank runs exactly one forward and one backward of every (microbatch, chunk)
    (no backward at all for an evaluation schedule)."""
    expected = {(mb, v) for mb in range(num_microbatches) for v in range(vpp)}
    kinds = (Forward, Backward)
    if not any(isinstance(s, Backward) for steps in schedules for s in steps):
        kinds = (Forward,)
    for r, steps in enumerate(schedules):
        for kind in kinds:
            got = [(s.mb, s.chunk) for s in steps if isinstance(s, kind)]
            if sorted(got) != sorted(expected):
                raise ScheduleError(f"rank {r}: {kind.__name__} covers {sorted(got)}, "
                                    f"expected each of {sorted(expected)} once")
