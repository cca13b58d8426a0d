"""Run logging: one console line per log interval; wandb and TensorBoard when asked; and the
metrics file beside the checkpoints that `tools/report.py` draws.

Each line says where the run is (`Progress`): `train iter 120/200 | elapsed 0:02:41 | ETA 0:01:47
| tokens 1.97M | loss ...`; the run ends with a one-paragraph summary (`RunLogger.summary`).

metrics.jsonl holds one line per logged iteration, and a `"split": "start"` line each time a run
(fresh or resumed) begins, so a report can tell the runs in one folder apart. The progress
fields are added to each line as `train_iters`, `elapsed_s`, `eta_s` and `tokens`. A wandb run's id is
kept in the run folder (`wandb_run_id`), so a resumed run continues the same wandb run.
"""
from __future__ import annotations

import logging
import os
import time

from megazoo.training.config.run_config import LoggingConfig
from megazoo.training.monitor.journal import RunJournal

logger = logging.getLogger("megazoo.train")
THROUGHPUT = ("tokens_per_s", "tflops_per_rank", "mfu")  # on the console with --log-throughput
WANDB_ID = "wandb_run_id"


class Progress:
    """Where a run stands: the iteration of the total, the time since this process began
    training, the time left at this process's pace so far (evaluations and saves included),
    and the tokens trained on since the first iteration (resumed runs included)."""

    def __init__(self, total_iterations: int, start_iteration: int, seq_length: int,
                 clock=time.monotonic):
        self.total, self.start_iteration, self.seq_length = total_iterations, start_iteration, seq_length
        self.clock, self.began = clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.began

    def fields(self, iteration: int, consumed_samples: int) -> dict:
        elapsed, done = self.elapsed(), iteration - self.start_iteration
        eta = elapsed / done * max(self.total - iteration, 0) if done > 0 else None
        return dict(train_iters=self.total, elapsed_s=elapsed, eta_s=eta,
                    tokens=consumed_samples * self.seq_length)


class RunLogger:
    """Writes metrics from the rank that owns them (rank 0 after reduction)."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, enabled: bool, journal: RunJournal,
                 start_iteration: int = 0, progress: Progress | None = None):
        self.cfg, self.enabled, self.journal, self.wandb, self.tensorboard = cfg, enabled, journal, None, None
        self.progress = progress
        self.losses: dict[str, list[tuple[int, float]]] = {}  # per split: (iteration, loss) logged
        if not enabled:
            return
        journal.metrics(start_iteration, "start", dict(time=time.time(), resumed=start_iteration > 0))
        if cfg.wandb_project:
            self.wandb = _init_wandb(cfg, run_config, journal.dir)
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(cfg.tensorboard_dir)

    def log(self, metrics: dict, step: int, prefix: str = "train") -> None:
        if not self.enabled:
            return
        where = f"{prefix} iter {step}"
        if self.progress is not None:
            where += f"/{self.progress.total}"
            if "consumed_samples" in metrics:
                metrics = {**self.progress.fields(step, metrics["consumed_samples"]), **metrics}
        if "loss" in metrics:
            self.losses.setdefault(prefix, []).append((step, metrics["loss"]))
        shown = {k: v for k, v in metrics.items() if k != "train_iters" and
                 (self.cfg.log_throughput or k not in THROUGHPUT)}
        logger.info(" | ".join([where] + [_fmt(k, v) for k, v in shown.items()]))
        self.journal.metrics(step, prefix, metrics)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)
        if self.tensorboard is not None:
            for k, v in metrics.items():
                if isinstance(v, list):  # one curve per element (e.g. tokens per expert)
                    for i, x in enumerate(v):
                        self.tensorboard.add_scalar(f"{prefix}/{k}/{i}", x, step)
                else:
                    self.tensorboard.add_scalar(f"{prefix}/{k}", v, step)

    def summary(self, iteration: int, consumed_samples: int, checkpoints: list[str],
                save_dir: str | None) -> str:
        """The run's last paragraph (also a `summary` event in the journal); returns it."""
        if not self.enabled:
            return ""
        p = self.progress
        total = p.total if p else iteration
        start = p.start_iteration if p else 0
        tokens = consumed_samples * p.seq_length if p else None
        head = "run finished" if iteration >= total else "run stopped early"
        text = [f"{head}: iteration {iteration} of {total} ({iteration - start} in this run)"]
        if tokens is not None:
            text.append(f"{_count(tokens)} tokens seen")
        if p:
            text.append(f"{_clock(p.elapsed())} of training in this run")
        sets = [(s, f"{s} validation loss") for s in self.losses if s.startswith("valid-")]
        for split, name in (("train", "training loss"), ("valid", "validation loss"), *sets):
            seen = self.losses.get(split)
            if seen:
                best = min(seen, key=lambda x: x[1])
                text.append(f"{name} {seen[-1][1]:.4f} at the end, best {best[1]:.4f} "
                            f"(iteration {best[0]})")
        if checkpoints:
            text.append(f"{len(checkpoints)} checkpoint{'s' * (len(checkpoints) > 1)} written to "
                        f"{save_dir} (the last: {os.path.basename(checkpoints[-1])})")
        else:
            text.append("no checkpoint written" + ("" if save_dir else " (no --save)"))
        paragraph = "; ".join(text) + "."
        logger.info("%s", paragraph)
        self.journal.event("summary", iteration=iteration, total=total, tokens=tokens,
                           checkpoints=checkpoints, text=paragraph)
        return paragraph

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _init_wandb(cfg: LoggingConfig, run_config: dict, run_dir: str | None):
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # no key: keep the run local
    import wandb
    run_id = None
    id_file = os.path.join(run_dir, WANDB_ID) if run_dir else None
    if id_file and os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip() or None
    run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, dir=cfg.wandb_save_dir,
                     config=run_config, id=run_id, resume="allow")
    if id_file and run_id is None:
        with open(id_file, "w") as f:
            f.write(run.id)
    return run


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _count(n: int) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _fmt(key: str, value) -> str:
    if key == "elapsed_s":
        return f"elapsed {_clock(value)}"
    if key == "eta_s":
        return f"ETA {'-' if value is None else _clock(value)}"
    if key == "tokens":
        return f"tokens {_count(value)}"
    if key == "loss":
        return f"{key} {value:.6f}"  # Megatron's precision
    if key == "ms_per_iter":
        return f"{key} {value:.1f}"
    if isinstance(value, list):
        return f"{key} [{' '.join(f'{x:.3g}' for x in value)}]"
    if isinstance(value, float):
        if key == "lr" or abs(value) < 1e-3 and value != 0:
            return f"{key} {value:.3e}"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:.4e}"
    return f"{key} {value}"
