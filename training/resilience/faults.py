"""What the loop does about a bad step (the health policy's actions) and the fault drills.

The verdicts come from `training/resilience/health.py`; here they are reported (log + journal), and under
--health-policy rollback the run reloads its latest checkpoint and replays (samples that fail again
are left out).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from megazoo.training.config.run_config import HealthConfig
from megazoo.training.checkpoint.resume import load
from megazoo.training.checkpoint.save import TrainState

logger = logging.getLogger(__name__)


def maybe_hang(cfg: HealthConfig, rank: int, iteration: int) -> None:
    """Fault drill (--inject-hang): this rank stalls before its next collective."""
    if cfg.inject_hang and cfg.inject_hang[0] == rank and cfg.inject_hang[1] == iteration:
        logger.warning("fault drill: rank %d sleeps %.0f s at iteration %d", rank, cfg.inject_hang[2],
                       iteration)
        time.sleep(cfg.inject_hang[2])


def report_unhealthy(journal, topo, iteration, verdict, samples, policy) -> None:
    action = {"warn": "kept", "skip": "update dropped", "rollback": "rolling back"}[policy]
    logger.warning("iteration %d: %s (%s) on rank %d; data samples %s; %s", iteration, verdict.kind,
                   verdict.detail, topo.rank, samples, action)
    if topo.rank == 0:
        journal.event(verdict.kind, iteration=iteration, rank=topo.rank, detail=verdict.detail,
                      samples=samples, policy=policy)


def roll_back(run, topo, chunks, opt, rng, data, journal, iteration, samples, skip) -> TrainState:
    """Reload the latest checkpoint and replay; samples that failed twice are left out."""
    source = dataclasses.replace(run, checkpoint=dataclasses.replace(
        run.checkpoint, load=run.checkpoint.save, finetune=False))
    state = load(source, topo, chunks, opt, rng)
    if skip:
        data.skip(samples)
    data.restart(state.consumed_samples)
    if topo.rank == 0:
        if skip:
            journal.event("skip_samples", iteration=iteration, ranges=samples)
        journal.event("rollback", iteration=iteration, to_iteration=state.iteration, samples=samples,
                      skipped=skip)
    logger.warning("rolled back from iteration %d to %d; samples %s %s", iteration, state.iteration,
                   samples, "failed again and will be skipped" if skip else "will be replayed once")
    return state
