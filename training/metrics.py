"""Throughput accounting: peak FLOP/s per device and MFU, memory per rank (the model's FLOPs per token
come from `TransformerConfig.model_flops_per_token`)."""
from __future__ import annotations

import logging
import resource
import sys

import torch

logger = logging.getLogger(__name__)

# NVIDIA's published dense peaks (FLOP/s, no sparsity) per precision, by device-name substring,
# most specific first: A100 SXM/PCIe (A100 datasheet: 312 TFLOPS bf16/fp16 tensor core, 19.5 fp32),
# H100 SXM (H100 datasheet: 989 bf16/fp16, 67 fp32), H100 PCIe (756, 51), H200 SXM (H200 datasheet:
# 989, 67). fp32 training does not use TF32 tensor cores unless torch is told to, so fp32 is the
# non-tensor-core figure. Other devices: pass --peak-flops.
PEAK_FLOPS = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
]


def device_peak_flops(device: torch.device, override: float | None = None,
                      precision: str = "fp32") -> tuple[float, str]:
    """Peak FLOP/s of one device at the run's precision and where it came from; 0 means no MFU.

    --peak-flops wins; GPUs in the table get NVIDIA's figure; anything else (the CPU included: a
    timed matmul on a shared CPU varies by 10x between runs) reports no MFU.
    """
    if override:
        return override, "--peak-flops"
    if device.type == "cpu":
        return 0.0, "no MFU on CPU without --peak-flops"
    name = torch.get_device_module(device).get_device_name(device)
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks[precision], f"NVIDIA dense {precision} peak of {key}"
    return 0.0, f"no MFU: {name} is not in training/metrics.py PEAK_FLOPS; pass --peak-flops"


def mfu(flops_per_s: float, peak: float) -> float:
    """Model FLOPs utilisation; above 1 means the peak is wrong (warned)."""
    value = flops_per_s / peak
    if value > 1:
        logger.warning("MFU %.2f is above 1: the peak %.3g FLOP/s is below what this rank achieved; "
                       "check --peak-flops", value, peak)
    return value


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU) of this process."""
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
