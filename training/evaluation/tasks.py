"""Running lm-evaluation-harness tasks on a model in memory (a training run's chunks) and turning
its results into flat metrics.

`evaluate_tasks` leaves the run as it found it: the Python, NumPy and torch (CPU and device)
random states are saved before and restored after (lm_eval seeds them all), the chunks return
to their mode, and nothing touches the data iterator; evaluation draws no random number in the
model (eval mode: no dropout).
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)


def check_task_specs(specs: list[str]) -> None:
    """Refuse a spec that names a YAML file that is not there (before the run starts)."""
    for spec in specs:
        if spec.endswith((".yaml", ".yml")) and not os.path.isfile(spec):
            raise ValueError(f"--eval-tasks: {spec}: no such task file; give an lm-eval task "
                             f"name or the path of a task YAML file")


def task_manager(specs: list[str]):
    """lm_eval's task index: built-in tasks only when a spec is a name (indexing them all takes
    seconds); YAML paths load directly."""
    from lm_eval.tasks import TaskManager
    names = [s for s in specs if not s.endswith((".yaml", ".yml"))]
    return TaskManager(include_defaults=bool(names))


@contextlib.contextmanager
def preserved_random_state(device: torch.device):
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    accel = torch.get_device_module(device).get_rng_state(device) if device.type != "cpu" else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if accel is not None:
            torch.get_device_module(device).set_rng_state(accel, device)


def evaluate_tasks(lm, specs: list[str], manager=None, limit: int | None = None,
                   device: torch.device = torch.device("cpu")) -> tuple[dict, float]:
    """(flat metrics {"task/metric": value}, seconds) for `specs`; the dict is empty on the
    processes where lm_eval returns no results (LOCAL_RANK != 0)."""
    from lm_eval import simple_evaluate
    start = time.perf_counter()
    with preserved_random_state(device):
        results = simple_evaluate(model=lm, tasks=list(specs), task_manager=manager or task_manager(specs),
                                  limit=limit, log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    return flat_scores(results), time.perf_counter() - start


def flat_scores(results: dict | None) -> dict:
    """{"task/acc": 0.5, "task/acc_norm": ...}: numeric metrics of each task (stderr dropped)."""
    if not results:
        return {}
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{key.split(',')[0] if key.endswith(',none') else key.replace(',', '_')}"] = value
    return out
