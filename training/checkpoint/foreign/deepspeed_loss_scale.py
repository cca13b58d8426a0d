"""DeepSpeed's fp16 loss scaler, as its ZeRO optimizer files record it, in megazoo's terms.

Every `*_optim_states.pt` holds `loss_scaler`: a `LossScaler` (static: `cur_scale`, 1 for fp32
and bf16 runs) or, for fp16 with dynamic scaling, a `DynamicLossScaler` (`cur_scale`, `cur_iter`,
`last_overflow_iter`, `cur_hysteresis`, and its settings `scale_window`, `delayed_shift`,
`min_scale`, `scale_factor`, `consecutive_hysteresis`). megazoo's `DynamicLossScaler`
(parallel/zero/loss_scaler.py) keeps the scale, a growth tracker and a hysteresis tracker; they
are set so that the resumed run's scale follows the one DeepSpeed's scaler would have taken:

- DeepSpeed grows the scale on a clean step when the clean steps before it since the last
  overflow (`cur_iter - last_overflow_iter - 1`) are a positive multiple of `scale_window`;
  megazoo when its tracker reaches the window. The tracker is therefore `(s - 1) % window` with
  `s` that count at the next step, and -1 when it is 0 (DeepSpeed waits window + 1 clean steps
  after the start or an overflow, megazoo window: after a later overflow the two differ by that
  one step, their rules' only difference).
- DeepSpeed lowers the scale on an overflow when its hysteresis is 1, else takes one off it;
  megazoo takes one off and lowers at 0: the hysteresis carries over as it is.

The settings are the resumed run's flags (`--loss-scale-window`, `--hysteresis`,
`--min-loss-scale`): the ones matching DeepSpeed's are logged once. A static scale other than 1
is logged as the `--loss-scale` to pass.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def scaler_scalars(osd: dict, where: str) -> dict[str, torch.Tensor]:
    """The `scaler.*` scalars of megazoo's optimizer state from one ZeRO optimizer state dict
    (empty for a static scaler; its scale is logged when it is not 1)."""
    scaler = osd.get("loss_scaler")
    if scaler is None:
        return {}
    scale = float(getattr(scaler, "cur_scale", 1.0))
    if not getattr(scaler, "dynamic", False):
        if scale != 1.0:
            logger.info("%s: DeepSpeed's static loss scale %g; resume with --fp16 --loss-scale %g",
                        where, scale, scale)
        return {}
    window = int(scaler.scale_window)
    shift = int(getattr(scaler, "delayed_shift", 1))
    clean = int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 1
    growth = (clean - 1) % window if clean > 0 else -1
    hysteresis = 1 if shift == 1 else int(getattr(scaler, "cur_hysteresis", shift))
    logger.info("%s: DeepSpeed's dynamic loss scale %g carried over; its settings are "
                "--loss-scale-window %d --hysteresis %d --min-loss-scale %g", where, scale,
                window, shift, float(scaler.min_scale))
    if float(getattr(scaler, "scale_factor", 2.0)) != 2.0:
        logger.warning("%s: DeepSpeed's loss scale factor %g; megazoo grows and lowers the "
                       "scale by 2", where, float(scaler.scale_factor))
    if getattr(scaler, "consecutive_hysteresis", False):
        logger.warning("%s: DeepSpeed's consecutive_hysteresis refilled the hysteresis on every "
                       "clean step; megazoo refills it when the scale grows", where)
    return {"scaler.loss_scale": torch.tensor(scale, dtype=torch.float64),
            "scaler.growth_tracker": torch.tensor(growth),
            "scaler.hysteresis_tracker": torch.tensor(hysteresis)}
