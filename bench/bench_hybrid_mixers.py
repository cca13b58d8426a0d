"""The chunked linear-mixer kernels' forward + backward against transformers' own PyTorch
fallbacks on the same inputs, side by side (CPU, fp32):

  gated delta rule   megazoo parallel/kernels/delta_rule.chunk_delta_rule
                     vs transformers.models.qwen3_5 torch_chunk_gated_delta_rule
  Mamba-2 SSD scan   megazoo parallel/kernels/ssd.chunk_ssd
                     vs transformers.models.nemotron_h mamba2_chunk_scan

    python -m bench.bench_hybrid_mixers [--seq 1024 --heads 8 --rounds 3 --threads 2]

Writes bench/results/hybrid_mixers.json (median seconds per forward+backward, the ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _time(fn, rounds):
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fwd_bwd(fn, inputs):
    def run():
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out.square().sum().backward()
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/hybrid_mixers")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from megazoo.parallel.kernels.delta_rule import chunk_delta_rule
    from megazoo.parallel.kernels.ssd import chunk_ssd
    g = torch.Generator().manual_seed(0)
    b, t, h, d, n = a.batch, a.seq, a.heads, a.head_dim, a.state
    q, k, v = (torch.randn(b, t, h, d, generator=g) for _ in range(3))
    decay, beta = -torch.rand(b, t, h, generator=g) * 0.1, torch.rand(b, t, h, generator=g)
    delta = {
        "megazoo": _fwd_bwd(lambda *x: chunk_delta_rule(*x, chunk_size=a.chunk)[0], (q, k, v, decay, beta)),
        "transformers": _fwd_bwd(lambda q, k, v, g_, bt: torch_chunk_gated_delta_rule(
            q, k, v, g=g_, beta=bt, chunk_size=a.chunk, use_qk_l2norm_in_kernel=True)[0],
            (q, k, v, decay, beta)),
    }
    groups = max(1, h // 4)
    x, dt = torch.randn(b, t, h, d, generator=g), torch.randn(b, t, h, generator=g)
    B, C = (torch.randn(b, t, groups, n, generator=g) for _ in range(2))
    A = -torch.rand(h, generator=g) - 0.5
    D, dt_bias = torch.randn(h, generator=g), torch.randn(h, generator=g)
    ssd = {
        "megazoo": _fwd_bwd(lambda *z: chunk_ssd(*z, chunk_size=a.chunk)[0], (x, dt, A, B, C, D, dt_bias)),
        "transformers": _fwd_bwd(lambda x_, dt_, A_, B_, C_, D_, bias: mamba2_chunk_scan(
            x_, dt_, A_, B_, C_, a.chunk, D=D_, dt_bias=bias, dt_softplus=True),
            (x, dt, A, B, C, D, dt_bias)),
    }
    result = {"shape": vars(a)}
    for name, pair in (("gated_delta_rule", delta), ("mamba2_ssd", ssd)):
        ours, theirs = _time(pair["megazoo"], a.rounds), _time(pair["transformers"], a.rounds)
        result[name] = {"megazoo_s": ours, "transformers_s": theirs, "speedup": theirs / ours}
        print(f"{name:18s} forward+backward  megazoo {ours * 1e3:8.1f} ms   transformers "
              f"{theirs * 1e3:8.1f} ms   x{theirs / ours:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
