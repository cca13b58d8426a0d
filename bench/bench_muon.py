"""Muon's cost: the optimizer's share of the step time, against AdamW, and Newton-Schulz by dtype.

One process, the ZeRO optimizer on a GPT (default: 12 layers, hidden 768, GPT-2 small's matrices;
sequence 512, micro batch 4 on a GPU, smaller on a CPU). For each of AdamW, Muon with
Newton-Schulz in fp32 and Muon in bf16, it times forward + backward and the optimizer step
separately (synchronised on a GPU) and prints the optimizer's share of the step. The measured
share depends on the tokens per step (Newton-Schulz costs the same for any batch), so it also
prints the FLOP ratio and what it gives at 0.5M tokens per step. Then it times Newton-Schulz
alone on one (4h, h) MLP matrix in fp32 and bf16: the figure behind the default --muon-ns-dtype.

    python bench/bench_muon.py                          # CPU: hidden 768, 4 layers, seq 128
    python bench/bench_muon.py --layers 12 --seq 512 --batch 4  # the GPU size

Writes bench/results/muon.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megazoo.models.config import TransformerConfig  # noqa: E402
from megazoo.models.language_model import TransformerLanguageModel  # noqa: E402
from megazoo.parallel.topology import ParallelTopology  # noqa: E402
from megazoo.parallel.zero import OptimizerConfig, build_optimizer  # noqa: E402
from megazoo.parallel.zero.muon import MuonSettings, newton_schulz  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(args, optimizer: str, ns_dtype: str) -> dict:
    topo = ParallelTopology.single()
    cfg = TransformerConfig(vocab_size=50257, hidden_size=args.hidden, num_layers=args.layers,
                            num_attention_heads=args.hidden // 64, ffn_hidden_size=4 * args.hidden,
                            max_position_embeddings=args.seq, seed=1)
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(
        optimizer=optimizer, lr=1e-3, weight_decay=0.1, clip_grad=1.0,
        muon=MuonSettings(ns_dtype=ns_dtype)),
        torch.bfloat16 if topo.device.type == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(0)
    fb, st = [], []
    for i in range(args.warmup + args.iters):
        tokens = torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g).to(topo.device)
        _sync(topo.device)
        t0 = time.perf_counter()
        opt.backward(model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean())
        _sync(topo.device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        _sync(topo.device)
        t2 = time.perf_counter()
        if i >= args.warmup:
            fb.append(t1 - t0)
            st.append(t2 - t1)
    fwd_bwd, step = statistics.median(fb), statistics.median(st)
    return {"optimizer": optimizer, "ns_dtype": ns_dtype if optimizer == "muon" else None,
            "forward_backward_s": fwd_bwd, "optimizer_step_s": step,
            "optimizer_share": step / (fwd_bwd + step)}


def newton_schulz_flops(model, steps: int = 5) -> tuple[float, float]:
    """(Newton-Schulz FLOPs of one optimizer step, forward + backward FLOPs per token ~ 6 x the
    parameters in matmuls) for the Muon matrices of `model`: their ratio over the tokens of a step
    is the optimizer's share a compute-bound device would see."""
    ns = dense = 0.0
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embedding" not in name:
            m, n = max(p.shape), min(p.shape)
            ns += steps * (2 * 2 * m * n * n + 2 * n ** 3)  # X X^T, A X, and the n x n B = bA + cA^2
            dense += 6 * m * n
    return ns, dense


def time_newton_schulz(hidden: int, device: torch.device, repeats: int = 5) -> dict:
    x = torch.randn(4 * hidden, hidden, device=device)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        newton_schulz(x, MuonSettings().ns_coefficients, 5, dtype)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            newton_schulz(x, MuonSettings().ns_coefficients, 5, dtype)
        _sync(device)
        out[name] = (time.perf_counter() - t0) / repeats
    return out


def main():
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12 if gpu else 4)
    p.add_argument("--seq", type=int, default=512 if gpu else 128)
    p.add_argument("--batch", type=int, default=4 if gpu else 2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    device = ParallelTopology.single().device
    topo = ParallelTopology.single()
    shape = TransformerConfig(vocab_size=50257, hidden_size=args.hidden, num_layers=args.layers,
                              num_attention_heads=args.hidden // 64,
                              ffn_hidden_size=4 * args.hidden, max_position_embeddings=args.seq)
    ns_flops, per_token = newton_schulz_flops(TransformerLanguageModel(shape, topo))
    rows = [time_steps(args, "adamw", "bf16"), time_steps(args, "muon", "fp32"),
            time_steps(args, "muon", "bf16")]
    ns = time_newton_schulz(args.hidden, device)
    print(f"device {device}, hidden {args.hidden}, layers {args.layers}, seq {args.seq}, "
          f"batch {args.batch}")
    for r in rows:
        label = r["optimizer"] + (f" (NS {r['ns_dtype']})" if r["ns_dtype"] else "")
        print(f"  {label:18s} fwd+bwd {r['forward_backward_s'] * 1e3:8.1f} ms   step "
              f"{r['optimizer_step_s'] * 1e3:8.1f} ms   optimizer share "
              f"{100 * r['optimizer_share']:5.1f}%")
    print(f"  Newton-Schulz (5 steps) on one ({4 * args.hidden}, {args.hidden}) matrix: "
          f"fp32 {ns['fp32'] * 1e3:.1f} ms, bf16 {ns['bf16'] * 1e3:.1f} ms")
    tokens = args.batch * args.seq
    print(f"  FLOPs: Newton-Schulz {ns_flops / 1e9:.1f} G per step, matmuls {per_token / 1e6:.1f} M "
          f"per token: {100 * ns_flops / (ns_flops + per_token * tokens):.1f}% of this step's "
          f"{tokens} tokens; at 0.5M tokens per step (per data-parallel rank, before ZeRO deals "
          f"the matrices out) {100 * ns_flops / (ns_flops + per_token * 524288):.2f}%")
    os.makedirs(RESULTS, exist_ok=True)
    name = "muon_cuda.json" if device.type == "cuda" else "muon.json"
    with open(os.path.join(RESULTS, name), "w") as f:
        json.dump({"device": str(device), "args": vars(args), "steps": rows,
                   "newton_schulz_flops_per_step": ns_flops, "matmul_flops_per_token": per_token,
                   "newton_schulz_s": ns}, f, indent=1)


if __name__ == "__main__":
    main()
