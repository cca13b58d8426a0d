"""Health checks on every step: non-finite loss or gradient norm, and loss spikes.

A spike is a loss whose robust z-score against the trailing window of healthy losses exceeds a
threshold: z = (loss - median) / (1.4826 * MAD), with the median absolute deviation standing in
for the standard deviation so that one earlier spike does not hide the next. What to do about a
bad step is a policy: warn (log and carry on), skip (drop this step's update) or rollback (reload
the last checkpoint and skip the offending samples), as BLOOM-176B and OPT-175B did by hand.
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
    collective_timeout: float = 0.0  # --collective-timeout seconds; 0 disables the watchdog
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
