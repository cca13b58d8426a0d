"""Throughput accounting: model FLOPs per step, peak FLOP/s per device, memory per rank."""
from __future__ import annotations

import resource
import sys
import time

import torch

from models.config import TransformerConfig

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device-name substring, most specific first.
PEAK_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("A10G", 125e12), ("L40S", 362e12),
    ("L4", 121e12), ("V100", 125e12), ("T4", 65e12), ("MI300X", 1307e12), ("MI250X", 383e12),
]


def model_flops_per_token(cfg: TransformerConfig, seq_length: int) -> float:
    """Forward + backward FLOPs per token (3x forward), no recompute (the MFU convention).

    Forward per token: 2 FLOPs per multiply-add over the QKV projection (h^2 for queries plus
    2 h^2 * kv_heads / heads for keys and values), the attention output (h^2), the MLP (2hf, or
    3hf for SwiGLU's gate, up and down), the attention scores and values (2 * 2 * s * h per
    layer), and the logits (h * V).
    """
    h, f, L, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    kv = (cfg.num_query_groups or cfg.num_attention_heads) / cfg.num_attention_heads
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * f
    forward = 2 * L * ((2 + 2 * kv) * h * h + mlp) + 4 * L * seq_length * h + 2 * h * v
    return 3.0 * forward


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
