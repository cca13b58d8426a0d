"""Run logging: one console line per log interval; wandb and TensorBoard when asked; and the
metrics file beside the checkpoints that `tools/report.py` draws."""
from __future__ import annotations

import logging
import os

from .config import LoggingConfig
from .journal import RunJournal

logger = logging.getLogger("megazoo.train")


class RunLogger:
    """Writes metrics from the rank that owns them (rank 0 after reduction)."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, enabled: bool, journal: RunJournal):
        self.enabled, self.journal, self.wandb, self.tensorboard = enabled, journal, None, None
        if not enabled:
            return
        if cfg.wandb_project:
            if not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")  # no key: keep the run local
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name,
                                    dir=cfg.wandb_save_dir, config=run_config)
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(cfg.tensorboard_dir)

    def log(self, metrics: dict, step: int, prefix: str = "train") -> None:
        if not self.enabled:
            return
        logger.info(" | ".join([f"{prefix} iter {step}"] + [_fmt(k, v) for k, v in metrics.items()]))
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


def _fmt(key: str, value) -> str:
    if isinstance(value, list):
        return f"{key} [{' '.join(f'{x:.3g}' for x in value)}]"
    if isinstance(value, float):
        if key == "lr" or abs(value) < 1e-3 and value != 0:
            return f"{key} {value:.3e}"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:.4e}"
    return f"{key} {value}"
