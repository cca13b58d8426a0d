"""Learning-rate warmup and decay, and batch-size rampup, as pure functions of progress.

Both are functions of counters the checkpoint stores (iteration, consumed samples), so a resumed
run recomputes exactly the same values: no scheduler object state to save.
"""
from __future__ import annotations

import math

from megazoo.training.config.run_config import ScheduleConfig


def learning_rate(cfg: ScheduleConfig, iteration: int) -> float:
    """LR for the step that follows `iteration` completed steps (Megatron's shapes)."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = cfg.lr_decay_iters or cfg.train_iters
    progress = min(max(iteration - warmup, 0) / max(decay_iters - warmup, 1), 1.0)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - progress
    elif cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    else:
        raise ValueError(f"--lr-decay-style {cfg.lr_decay_style!r} is not one of constant, linear, cosine")
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def global_batch_size(cfg: ScheduleConfig, consumed_samples: int) -> int:
    """Global batch for the next step under --rampup-batch-size START INCREMENT SAMPLES.

    The batch grows from START by INCREMENT in equal sample intervals until it reaches the
    global batch size after SAMPLES samples (Megatron's linear rampup).
    """
    if cfg.rampup_batch_size is None:
        return cfg.global_batch_size
    start, increment, ramp_samples = cfg.rampup_batch_size
    steps = max((cfg.global_batch_size - start) // increment, 1)
    per_increment = ramp_samples / steps
    return min(start + int(consumed_samples / per_increment) * increment, cfg.global_batch_size)
