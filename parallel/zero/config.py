"""Typed configuration of the ZeRO / mixed-precision optimizer, validated with clear errors."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ZeroConfigError
from .muon import MuonSettings
from .qk_clip import QKClipSettings


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (Megatron / DeepSpeed defaults)."""

    initial_scale: float = 2.0 ** 16  # --initial-loss-scale
    growth_interval: int = 1000  # --loss-scale-window: clean steps before the scale doubles
    hysteresis: int = 2  # --hysteresis: overflows tolerated before the scale is lowered
    min_scale: float = 1.0  # --min-loss-scale
    backoff: float = 0.5
    growth: float = 2.0
    static_scale: float | None = None  # --loss-scale: a fixed scale, no dynamics


@dataclass(frozen=True)
class OptimizerConfig:
    zero_stage: int = 0  # --zero-stage 0..3
    optimizer: str = "adamw"  # --optimizer adamw | sgd | muon (Muon on matrices, AdamW on the rest)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    muon: MuonSettings = field(default_factory=MuonSettings)  # optimizer muon only
    qk_clip: QKClipSettings | None = None  # --qk-clip: rescale Q/K after each step (None: off)
    # Megatron convention: no decay on biases and norm weights (any parameter with ndim < 2).
    decay_biases_and_norms: bool = False
    clip_grad: float = 0.0  # --clip-grad; 0 disables clipping (the norm is still reported)
    # (The weights' dtype is the model's, TransformerConfig.params_dtype; the optimizer is given
    # it by whoever builds it: `build_optimizer(..., dtype=run.model.dtype)`.)
    # Gradient buffer dtype. "fp32" accumulates micro-batch gradients and reduces them in fp32
    # (accurate, Megatron's default); "model" keeps them in the model dtype (DeepSpeed's and
    # the ZeRO paper's accounting: 2 bytes per gradient).
    grad_dtype: str = "fp32"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    bucket_numel: int = 40_000_000  # elements per gradient bucket (stages 0-2)
    max_inflight_buckets: int = 2  # stage 2/3: unreduced bucket buffers alive at once
    zero3_prefetch: bool = True  # stage 3: gather the next layer while this one runs
    offload: str = "none"  # none | cpu | nvme
    offload_dir: str | None = None  # nvme: directory for the swap files
    # nvme: buckets whose states may sit in memory at once; >= 2 reads ahead and writes behind
    offload_resident_buckets: int = 2
    raise_on_nonfinite: bool = False  # raise instead of skipping when the loss/grads are NaN/inf

    def grad_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The gradient buffers' dtype for weights of `model_dtype`."""
        return torch.float32 if self.grad_dtype == "fp32" else model_dtype

    def validate(self, pp: int = 1) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.zero_stage == 3 and pp > 1:
            raise ZeroConfigError(
                "--zero-stage 3 does not compose with --pipeline-model-parallel-size > 1; "
                "use --zero-stage 1 or 2 with pipelines")
        if self.grad_dtype not in ("fp32", "model"):
            raise ZeroConfigError(f"grad_dtype must be 'fp32' or 'model', got {self.grad_dtype!r}")
        if self.optimizer not in ("adamw", "sgd", "muon"):
            raise ZeroConfigError(f"--optimizer must be adamw, sgd or muon, got {self.optimizer!r}")
        if self.optimizer == "muon":
            self.muon.validate()
        if self.qk_clip is not None:
            self.qk_clip.validate()
        if self.offload not in ("none", "cpu", "nvme"):
            raise ZeroConfigError(f"--offload must be none, cpu or nvme, got {self.offload!r}")
        if self.offload == "nvme" and not self.offload_dir:
            raise ZeroConfigError("--offload nvme needs --offload-dir (a local-disk directory)")
        if self.offload != "none" and self.zero_stage == 0:
            raise ZeroConfigError("--offload needs --zero-stage >= 1 (offload moves the sharded "
                                  "optimizer states); set --zero-stage 1")
        if self.clip_grad < 0:
            raise ZeroConfigError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if self.bucket_numel < 1 or self.max_inflight_buckets < 1 or \
                self.offload_resident_buckets < 1:
            raise ZeroConfigError("bucket_numel, max_inflight_buckets and "
                                  "offload_resident_buckets must be >= 1")
