"""Throughput accounting: peak FLOP/s per device and memory per rank (the model's FLOPs per token
come from `TransformerConfig.model_flops_per_token`); MoE routing statistics over the world."""
from __future__ import annotations

import resource
import sys
import time

import torch
import torch.distributed as dist

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


def moe_metrics(chunks, num_layers: int, device: torch.device) -> tuple[dict, dict]:
    """Routing statistics of every MoE layer since the last call, over all ranks (a collective:
    every rank calls it), then reset. Returns (summary: the aux and z losses as they enter the
    loss, summed over layers; the share of dropped assignments; the worst layer's load, i.e. its
    busiest expert's tokens over the mean), and per layer: load, dropped share, and each expert's
    share of the assignments)."""
    from models.moe import MoELayer
    num_experts = chunks[0].config.num_experts  # from the config: every rank joins the sum,
    if not num_experts:  # also a pipeline stage without MoE layers
        return {}, {}
    # Per global layer: [forwards, assignments, dropped, aux, z, tokens per expert...]
    table = torch.zeros(num_layers, 5 + num_experts, dtype=torch.float64, device=device)
    for chunk in chunks:
        for layer in chunk.layers.values():
            if isinstance(layer.mlp, MoELayer):
                stats = layer.mlp.stats
                table[layer.layer_number] = torch.cat([stats.totals, stats.tokens_per_expert])
                stats.reset()
    if dist.is_initialized():
        dist.all_reduce(table)  # TP copies count alike in numerator and denominator
    rows = [i for i in range(num_layers) if table[i, 0] > 0]
    if not rows:
        return {}, {}
    per_layer, aux, z, loads = {}, 0.0, 0.0, []
    for i in rows:
        forwards, assignments, dropped = table[i, :3].tolist()
        tokens = table[i, 5:]
        load = (tokens.max() / tokens.mean()).item() if tokens.sum() > 0 else float("nan")
        aux += table[i, 3].item() / forwards
        z += table[i, 4].item() / forwards
        loads.append(load)
        per_layer[f"layer{i}_load"] = load
        per_layer[f"layer{i}_dropped"] = dropped / max(assignments, 1)
        per_layer[f"layer{i}_tokens_per_expert"] = (tokens / max(assignments, 1)).tolist()
    dropped_share = table[rows, 2].sum().item() / max(table[rows, 1].sum().item(), 1)
    return dict(moe_aux_loss=aux, moe_z_loss=z, moe_dropped=dropped_share,
                moe_max_load=max(loads)), per_layer
