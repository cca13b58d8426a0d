"""Throughput accounting: peak FLOP/s per device and MFU, memory per rank (the model's FLOPs per token
come from `TransformerConfig.model_flops_per_token`); MoE routing statistics over the world."""
from __future__ import annotations

import logging
import resource
import sys

import torch

from megazoo.parallel import collectives as C

logger = logging.getLogger(__name__)

# NVIDIA's published dense peaks (FLOP/s, no sparsity) per precision, by device-name substring,
# most specific first: A100 SXM/PCIe (A100 datasheet: 312 TFLOPS bf16/fp16 tensor core, 19.5 fp32),
# H100 SXM (H100 datasheet: 989 bf16/fp16, 67 fp32), H100 PCIe (756, 51), H200 SXM (H200 datasheet:
# 989, 67). fp32 training does not use TF32 tensor cores unless torch is told to, so fp32 is the
# non-tensor-core figure. Other devices: pass --peak-flops.
# Keyed by the weights' dtype as TransformerConfig.params_dtype spells it.
PEAK_FLOPS = [
    ("H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
]


def device_peak_flops(device: torch.device, override: float | None = None,
                      params_dtype: str = "float32") -> tuple[float, str]:
    """Peak FLOP/s of one device for weights of `params_dtype` (TransformerConfig's spelling) and
    where it came from; 0 means no MFU.

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
            return peaks[params_dtype], f"NVIDIA dense {params_dtype} peak of {key}"
    return 0.0, f"no MFU: {name} is not in training/monitor/metrics.py PEAK_FLOPS; pass --peak-flops"


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


def moe_metrics(chunks, num_layers: int, device: torch.device) -> tuple[dict, dict]:
    """Routing statistics of every MoE layer since the last call, over all ranks (a collective:
    every rank calls it), then reset. Returns (summary: the aux and z losses as they enter the
    loss, summed over layers; the share of dropped assignments; the worst layer's load, i.e. its
    busiest expert's tokens over the mean), and per layer: load, dropped share, and each expert's
    share of the assignments)."""
    from megazoo.models.moe import moe_layers
    num_experts = chunks[0].config.num_experts  # from the config: every rank joins the sum,
    if not num_experts:  # also a pipeline stage without MoE layers
        return {}, {}
    num_layers += chunks[0].config.mtp_num_layers  # the prediction depths' layers follow
    # Per global layer: [forwards, assignments, dropped, aux, z, tokens per expert...]
    table = torch.zeros(num_layers, 5 + num_experts, dtype=torch.float64, device=device)
    for chunk in chunks:
        for layer in chunk.transformer_layers():
            for moe in moe_layers(layer):  # (an MoELayer, or one beside a dense MLP)
                stats = moe.stats
                table[layer.layer_number] = torch.cat([stats.totals, stats.tokens_per_expert])
                stats.reset()
    C.all_reduce(table, C.world())  # TP copies count alike in numerator and denominator
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


def mtp_metrics(chunks, device: torch.device) -> dict:
    """The multi-token prediction losses since the last call, over all ranks (a collective:
    every rank calls it), then reset: `mtp_loss` as it enters the training loss (scaling factor
    x the mean over depths) and each depth's own mean loss, `mtp_{k}_loss` (Megatron's names)."""
    from megazoo.models.multi_token_prediction import mtp_modules
    config = chunks[0].config
    if not config.mtp_num_layers:
        return {}
    table = torch.zeros(config.mtp_num_layers + 1, dtype=torch.float64, device=device)
    for block in mtp_modules(chunks):  # the last stage's; the other stages add zeros
        table += block.stats.totals
        block.stats.reset()
    C.all_reduce(table, C.world())  # TP copies count alike in numerator and denominator
    if table[0] == 0:
        return {}
    depths = (table[1:] / table[0]).tolist()
    out = {f"mtp_{k}_loss": v for k, v in enumerate(depths, start=1)}
    return dict(mtp_loss=config.mtp_loss_scaling_factor * sum(depths) / len(depths), **out)
