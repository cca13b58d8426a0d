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

POLICIES = ("warn", "skip", "rollback")


@dataclass(frozen=True)
class HealthConfig:
    policy: str = "warn"  # --health-policy warn | skip | rollback
    spike_zscore: float = 6.0  # --spike-zscore; 0 disables spike detection
    spike_window: int = 50  # --spike-window: healthy losses the statistics are taken over
    spike_min_history: int = 10  # no spike verdicts before this many healthy losses
    max_rollbacks: int = 5  # give up (raise) after this many rollbacks in one run
    max_bad_steps: int = 20  # --max-bad-steps: consecutive non-finite or skipped steps -> stop
    collective_timeout: float = 300.0  # --collective-timeout seconds; 0 disables the watchdog
    straggler_threshold: float = 1.25  # --straggler-threshold: slow if step time > x * median
    inject_nan_at: int | None = None  # --inject-nan-at-iteration: fault drill, once
    inject_hang: tuple[int, int, float] | None = None  # --inject-hang RANK ITER SECONDS: drill

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--health-policy must be one of {POLICIES}, got {self.policy!r}")
        if self.spike_window < 3:
            raise ValueError(f"--spike-window must be >= 3, got {self.spike_window}")


@dataclass
class Verdict:
    healthy: bool
    kind: str = "ok"  # ok | nonfinite | spike
    detail: str = ""


class HealthMonitor:
    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)

    def check(self, loss: float, grad_norm: float | None = None) -> Verdict:
        if not math.isfinite(loss):
            return Verdict(False, "nonfinite", f"loss is {loss}")
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Verdict(False, "nonfinite", f"gradient norm is {grad_norm}")
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


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint [start, end) ranges covering the same indices."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class SkippingDataset:
    """A dataset view without the samples in `skip` (sorted, disjoint [start, end) ranges).

    Training counts logical samples (consumed_samples); logical index i maps to the i-th physical
    sample not skipped, so a run that skipped a batch and a run that never had it agree.
    """

    def __init__(self, dataset, skip: list[tuple[int, int]]):
        self.dataset, self.skip = dataset, merge_ranges(skip)
        self.skipped = sum(e - s for s, e in self.skip)

    def __len__(self) -> int:
        return len(self.dataset) - self.skipped

    def physical(self, i: int) -> int:
        for s, e in self.skip:
            if i >= s:
                i += e - s
            else:
                break
        return i

    def __getitem__(self, i: int):
        return self.dataset[self.physical(i)]
