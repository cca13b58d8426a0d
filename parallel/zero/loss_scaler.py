"""Loss scaling for fp16: multiply the loss so small gradients survive fp16, unscale before the step.

`DynamicLossScaler` follows Megatron-LM's dynamic scaler: start high (2^16); an overflowing step
(inf/NaN gradient) is skipped; after `hysteresis` overflows the scale is multiplied by `backoff`
(never below `min_scale`); `growth_interval` clean steps in a row multiply it by `growth` and
refill the hysteresis budget. bf16 and fp32 use `NoLossScaler` (scale 1): bf16 has fp32's range.
"""
from __future__ import annotations

import logging

import torch

from .config import LossScaleConfig

logger = logging.getLogger(__name__)


class NoLossScaler:
    scale: float = 1.0
    dynamic = False

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class StaticLossScaler(NoLossScaler):
    def __init__(self, scale: float):
        self.scale = float(scale)


class DynamicLossScaler:
    dynamic = True

    def __init__(self, cfg: LossScaleConfig):
        if cfg.min_scale <= 0 or cfg.initial_scale < cfg.min_scale:
            raise ValueError(f"need 0 < --min-loss-scale <= --initial-loss-scale, got "
                             f"{cfg.min_scale} and {cfg.initial_scale}")
        if cfg.hysteresis < 1 or cfg.growth_interval < 1:
            raise ValueError("--hysteresis and --loss-scale-window must be >= 1")
        self.cfg = cfg
        self.scale = float(cfg.initial_scale)
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = cfg.hysteresis  # overflows left before the scale drops

    def update(self, found_inf: bool) -> None:
        cfg = self.cfg
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                old, self.scale = self.scale, max(self.scale * cfg.backoff, cfg.min_scale)
                logger.info("loss scale lowered %g -> %g after an overflow", old, self.scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == cfg.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = cfg.hysteresis
            self.scale *= cfg.growth

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"loss_scale": torch.tensor(self.scale, dtype=torch.float64),
                "growth_tracker": torch.tensor(self.growth_tracker),
                "hysteresis_tracker": torch.tensor(self.hysteresis_tracker)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale = float(state["loss_scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(dtype: torch.dtype, cfg: LossScaleConfig):
    """fp16 weights need a loss scale (their gradients underflow); bf16 and fp32 do not."""
    if dtype != torch.float16:
        return NoLossScaler()
    if cfg.static_scale is not None:
        return StaticLossScaler(cfg.static_scale)
    return DynamicLossScaler(cfg)
