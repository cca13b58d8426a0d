"""Health checks on every step: non-finite loss or gradient norm, loss spikes, and runs of steps
that make no progress.

A spike is a loss whose robust z-score against the trailing window of healthy losses exceeds a
threshold: z = (loss - median) / (1.4826 * MAD), with the median absolute deviation standing in
for the standard deviation so that one earlier spike does not hide the next. What to do about a
bad step is a policy: warn (log and carry on), skip (drop this step's update) or rollback (reload
the last checkpoint and replay), as BLOOM-176B and OPT-175B did by hand.

Mixed precision: an fp16 step skipped by the dynamic loss scaler (an overflow while it probes a
higher scale) is the scaler working, not a health event: it never triggers a rollback. But
`--max-bad-steps` consecutive steps without an applied update (non-finite losses, skipped or
dropped updates, whatever the cause and policy) stop the run with `RunHalted`. A rollback first
replays the same samples (the fault may have been transient); samples are left out of the
stream only when the same samples fail again.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from megazoo.training.config.run_config import HealthConfig

@dataclass
class Verdict:
    healthy: bool
    kind: str = "ok"  # ok | nonfinite | spike
    detail: str = ""


class HealthMonitor:
    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float) -> Verdict:
        """The verdict on a step's loss, before its update (a non-finite gradient norm is the
        optimizer's to find: it skips the step, and `after_step` turns that into a verdict)."""
        if not math.isfinite(loss):
            return Verdict(False, "nonfinite", f"loss is {loss}")
        z = self.zscore(loss)
        if self.cfg.spike_zscore > 0 and z is not None and z > self.cfg.spike_zscore:
            return Verdict(False, "spike", f"loss {loss:.4f} has robust z-score {z:.1f} over the last "
                                           f"{len(self.history)} steps (threshold {self.cfg.spike_zscore})")
        return Verdict(True)

    def zscore(self, loss: float) -> float | None:
        if len(self.history) < self.cfg.spike_min_history:
            return None
        h = np.asarray(self.history)
        median = float(np.median(h))
        mad = float(np.median(np.abs(h - median)))
        scale = 1.4826 * mad if mad > 0 else max(abs(median) * 1e-3, 1e-8)
        return (loss - median) / scale

    def record_healthy(self, loss: float) -> None:
        self.history.append(loss)

    def reset(self) -> None:
        self.history.clear()


class RunHalted(RuntimeError):
    """The run cannot make progress; the message says why and what to change."""


def after_step(verdict: Verdict, skipped: bool, reason: str, dynamic_scaler: bool) -> Verdict:
    """The verdict once the optimizer has stepped: a skipped update is a health event unless a
    dynamic loss scaler skipped it for an overflow with a finite loss (fp16 probing its scale)."""
    if skipped and verdict.healthy and not dynamic_scaler:
        return Verdict(False, "nonfinite", reason)
    return verdict


class ProgressGuard:
    """Counts consecutive steps without an applied update, and samples that failed before."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.bad_run = 0
        self.rollbacks = 0
        self.failed: list[list[tuple[int, int]]] = []  # sample ranges of rolled-back steps

    def count(self, applied: bool, iteration: int, detail: str) -> None:
        self.bad_run = 0 if applied else self.bad_run + 1
        if self.bad_run >= self.cfg.max_bad_steps:
            raise RunHalted(f"iteration {iteration}: {self.bad_run} consecutive steps without an "
                            f"update (last: {detail or 'update dropped'}); stopping (--max-bad-steps "
                            f"{self.cfg.max_bad_steps}). Resume from the last checkpoint with a lower "
                            f"--lr, --initial-loss-scale or another --health-policy")

    def roll_back(self, iteration: int, samples: list[tuple[int, int]]) -> bool:
        """Count a rollback; True when these samples failed before (skip them this time)."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_rollbacks:
            raise RunHalted(f"iteration {iteration}: {self.rollbacks} rollbacks in one run (more than "
                            f"{self.cfg.max_rollbacks}); stopping. Resume from the last checkpoint "
                            f"with a lower --lr or inspect the journal's samples")
        samples = [tuple(r) for r in samples]
        repeat = samples in self.failed
        if not repeat:
            self.failed.append(samples)
        return repeat
