"""Run logging: one console line per log interval; wandb and TensorBoard when asked; and the
metrics file beside the checkpoints that `tools/report.py` draws.

metrics.jsonl holds one line per logged iteration, and a `"split": "start"` line each time a run
(fresh or resumed) begins, so a report can tell the runs in one folder apart. A wandb run's id is
kept in the run folder (`wandb_run_id`), so a resumed run continues the same wandb run.
"""
from __future__ import annotations

import logging
import os
import time

from training.config.run_config import LoggingConfig
from training.monitor.journal import RunJournal

logger = logging.getLogger("megazoo.train")
THROUGHPUT = ("tokens_per_s", "tflops_per_rank", "mfu")  # on the console with --log-throughput
WANDB_ID = "wandb_run_id"


class RunLogger:
    """Writes metrics from the rank that owns them (rank 0 after reduction)."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, enabled: bool, journal: RunJournal,
                 start_iteration: int = 0):
        self.cfg, self.enabled, self.journal, self.wandb, self.tensorboard = cfg, enabled, journal, None, None
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
        shown = {k: v for k, v in metrics.items() if self.cfg.log_throughput or k not in THROUGHPUT}
        logger.info(" | ".join([f"{prefix} iter {step}"] + [_fmt(k, v) for k, v in shown.items()]))
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


def _fmt(key: str, value) -> str:
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
