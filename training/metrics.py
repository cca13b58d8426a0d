"""Throughput accounting: peak FLOP/s per device and memory per rank (the model's FLOPs per token
come from `TransformerConfig.model_flops_per_token`)."""
from __future__ import annotations

import resource
import sys
import time

import torch

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device-name substring, most specific first.
PEAK_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("A10G", 125e12), ("L40S", 362e12),
    ("L4", 121e12), ("V100", 125e12), ("T4", 65e12), ("MI300X", 1307e12), ("MI250X", 383e12),
]


def device_peak_flops(device: torch.device, override: float | None = None) -> tuple[float, str]:
    """Peak FLOP/s of one device, and where the number came from."""
    if override:
        return override, "--peak-flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_FLOPS:
            if key in name:
                return peak, f"table ({name})"
        return 0.0, f"unknown device {name}: pass --peak-flops"
    return measure_matmul_flops(), "measured fp32 matmul"


def measure_matmul_flops(n: int = 512, seconds: float = 0.3, dtype=torch.float32) -> float:
    """Achievable matmul FLOP/s of this process on the CPU (its own threads)."""
    g = torch.Generator().manual_seed(0)  # never touch the training RNG streams
    a, b = torch.randn(n, n, dtype=dtype, generator=g), torch.randn(n, n, dtype=dtype, generator=g)
    a @ b  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2.0 * n ** 3 * count / (time.perf_counter() - start)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU) of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
