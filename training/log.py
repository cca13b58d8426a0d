"""Run logging: one console line per log interval, and wandb when a project is given."""
from __future__ import annotations

import logging
import os

from .config import LoggingConfig

logger = logging.getLogger("megazoo.train")


class RunLogger:
    """Writes metrics from the rank that owns them (rank 0 after reduction)."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, enabled: bool):
        self.enabled, self.wandb = enabled, None
        if enabled and cfg.wandb_project:
            if not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")  # no key: keep the run local
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name,
                                    dir=cfg.wandb_save_dir, config=run_config)

    def log(self, metrics: dict, step: int, prefix: str = "train") -> None:
        if not self.enabled:
            return
        logger.info(" | ".join([f"{prefix} iter {step}"] + [_fmt(k, v) for k, v in metrics.items()]))
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key == "lr" or abs(value) < 1e-3 and value != 0:
            return f"{key} {value:.3e}"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:.4e}"
    return f"{key} {value}"
