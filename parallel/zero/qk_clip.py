"""QK-clip (MuonClip, Kimi K2 technical report, arXiv 2507.20534): after each optimizer step,
every attention head whose largest pre-softmax logit S_max^h in that step's forward exceeded
the threshold tau has its query and key projections scaled so that its logits shrink by

    gamma_h = min(1, tau / S_max^h)

(q rows by gamma^alpha, k rows by gamma^(1 - alpha); alpha = 0.5 is the report's sqrt(gamma)
each, Megatron-core's --qk-clip-alpha the balance; a grouped-query key shared by several heads
is left alone and each query head takes its whole gamma, as the report leaves MLA's shared
rotary key alone). Biases of the fused QKV projection scale with their rows, so q.k scales by
gamma exactly. Multi-latent attention (`models/mla.py`) follows the report: q_C and k_C (the
heads' no-rope rows of q_up / q_proj and kv_up) by gamma^alpha and gamma^(1 - alpha), q_R (the
heads' rope rows) by gamma, the shared k_R (kv_down's k_pe rows) and the values untouched.
Which parameter rows take which factor is the layer's to say (`qk_clip_row_scales`). The
momentum and Adam moments are not touched (the report rescales weights only).

Who does what: each attention layer (`models/attention.py`) folds its heads' largest logit of
every training forward into `max_logits` (`parallel/kernels/max_logit.py`), without
communicating. The step reduces those maxima with a MAX over data x context parallelism (the
ranks that saw other samples; heads are TP-sharded, so each TP rank clips its own heads, and a
pipeline stage its own layers), then multiplies this rank's fp32 master shard of each q/k
projection weight (and bias) by the row factors, after the optimizer's update and before the weights are
written and gathered, so every ZeRO stage, offload and precision clips the same numbers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from .. import collectives as C
from .errors import ZeroConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QKClipSettings:
    threshold: float = 100.0  # --qk-clip-threshold (Megatron-core's default)
    alpha: float = 0.5  # --qk-clip-alpha: the query's share of the rescaling

    def validate(self) -> None:
        if not self.threshold > 0:
            raise ZeroConfigError(f"--qk-clip-threshold must be > 0, got {self.threshold}")
        if not 0 < self.alpha < 1:
            raise ZeroConfigError(f"--qk-clip-alpha must be in (0, 1), got {self.alpha}")


def qk_clip_refusal(*, qk_layernorm: bool, cp: int) -> str | None:
    """Why --qk-clip cannot run on this model and layout (None: it can): the one rule, used by
    the flag checks and by the optimizer."""
    if qk_layernorm:
        return ("--qk-clip with --qk-layernorm: the query/key RMSNorm undoes any rescaling of "
                "the projections; drop --qk-clip (the norm already bounds the logits)")
    if cp > 1:
        return (f"--qk-clip with --context-parallel-size {cp}: the heads' largest logits are "
                f"not tracked inside context-parallel attention; drop --qk-clip or use cp 1")
    return None


class QKClip:
    """Tracks the attention layers of `modules` and clips their q/k master shards each step."""

    def __init__(self, settings: QKClipSettings, modules, topo):
        settings.validate()
        self.s, self.topo = settings, topo
        self.layers = [m for root in modules for m in root.modules()
                       if hasattr(m, "qk_clip_row_scales")]
        norm = any(m.qk_layernorm for m in self.layers)
        refusal = qk_clip_refusal(qk_layernorm=norm, cp=topo.cp)
        if refusal:
            raise ZeroConfigError(refusal)
        for m in self.layers:
            m.track_max_logits = True
        self.row_scales: dict[int, torch.Tensor] = {}  # id(q/k projection parameter) -> [rows]
        self.last_max: list[torch.Tensor] = []  # per layer [heads_local]: the reduced maxima
        self.last_gamma: list[torch.Tensor] = []
        self.clipped = 0  # heads this rank clipped at the last step

    def prepare(self) -> int:
        """Reduce this step's maxima, reset them, and set the row factors; the number of heads
        this rank clips."""
        self.row_scales.clear()
        if not self.layers:
            return 0
        device = self.topo.device
        seen = [m.max_logits if m.max_logits is not None else
                torch.full((m.heads_local,), float("-inf"), device=device) for m in self.layers]
        flat = torch.cat([t.float().to(device) for t in seen])
        if not C.is_single(self.topo.dp_cp_group):
            flat = C.all_reduce(flat, self.topo.dp_cp_group, op=ReduceOp.MAX)
        for m in self.layers:
            m.max_logits = None
        self.last_max = list(flat.split([m.heads_local for m in self.layers]))
        self.last_gamma, clipped = [], 0
        for m, top in zip(self.layers, self.last_max):
            over = top > self.s.threshold
            gamma = torch.where(over, self.s.threshold / top, torch.ones_like(top))
            self.last_gamma.append(gamma)
            if bool(over.any()):
                clipped += int(over.sum())
                for p, rows in m.qk_clip_row_scales(gamma, self.s.alpha):
                    self.row_scales[id(p)] = rows
        if clipped:
            logger.debug("QK-clip: %d heads over %g", clipped, self.s.threshold)
        self.clipped = clipped
        return clipped

    def apply(self, bucket, master: torch.Tensor) -> None:
        """Scale the part of `master` (this rank's shard of `bucket`) that holds clipped rows."""
        for slot, start, end in bucket.shard_ranges():
            rows = self.row_scales.get(id(slot.param))
            if rows is None:
                continue
            per_row = slot.numel // rows.numel()
            first, last = start - slot.offset, end - slot.offset  # elements of the parameter
            r0, r1 = first // per_row, -(-last // per_row)
            factors = rows[r0:r1].repeat_interleave(per_row)[first - r0 * per_row:
                                                             last - r0 * per_row]
            lo = start - bucket.shard_start
            master[lo:lo + (end - start)].mul_(factors.to(master.device))
