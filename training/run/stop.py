"""When a run stops early, and how the process ends.

SIGTERM (a scheduler's notice) and SIGINT (Ctrl-C) do the same thing: the current step finishes
(an evaluation stops after its current batch), every rank agrees on the stop, a checkpoint is
written when --save is set, and the process exits with 128 + the signal number (143 for SIGTERM,
130 for SIGINT). Under torchrun, Ctrl-C reaches the workers twice (from the terminal and forwarded by torchrun): the handler only records the signal.

--exit-interval and --exit-duration-in-mins stop the same way, with a checkpoint, and exit 0.
"""
from __future__ import annotations

import signal
import threading
import time

import torch

from megazoo.parallel import collectives as C

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOG_FAILED = "the run log could not be written"  # `agreed`'s reason when a rank's log write failed


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal."""
    return 128 + signum


class StopRequests:
    """Records SIGTERM/SIGINT while installed (a context manager); `agreed` decides, collectively,
    whether the run stops after this step and why."""

    def __init__(self, exit_interval: int | None = None, exit_duration_mins: float | None = None,
                 start: float | None = None):
        """`start`: time.monotonic() when the run began (its setup counts towards the duration)."""
        self.signum = 0
        self.exit_interval, self.exit_duration_mins = exit_interval, exit_duration_mins
        self.start = time.monotonic() if start is None else start
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, _frame) -> None:
        self.signum = max(self.signum, signum)

    def signalled(self, device) -> int:
        """The stop signal any rank received (0: none), the same on every rank: one all-reduce
        (asked between evaluation batches, so that a stop does not wait for the evaluation)."""
        t = torch.tensor([float(self.signum)], dtype=torch.float64, device=device)
        C.all_reduce(t, C.world(), op=C.ReduceOp.MAX)
        return int(t[0].item())

    def agreed(self, iteration: int, device, log_failed: bool = False) -> tuple[int, str]:
        """(signal number or 0, reason or ""), the same on every rank: one all-reduce per step.
        `log_failed`: this rank could not write the run log; on every rank the reason is then
        LOG_FAILED (the run ends there, with no checkpoint written onto the full disk)."""
        elapsed_mins = (time.monotonic() - self.start) / 60
        t = torch.tensor([float(self.signum), elapsed_mins, float(log_failed)], dtype=torch.float64,
                         device=device)
        C.all_reduce(t, C.world(), op=C.ReduceOp.MAX)  # the slowest rank's clock decides
        signum, elapsed_mins = int(t[0].item()), t[1].item()
        if t[2].item():
            return 0, LOG_FAILED
        if signum:
            return signum, f"{signal.Signals(signum).name}"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return 0, f"--exit-interval {self.exit_interval}"
        if self.exit_duration_mins and elapsed_mins >= self.exit_duration_mins:
            return 0, f"--exit-duration-in-mins {self.exit_duration_mins:g} ({elapsed_mins:.1f} min)"
        return 0, ""
