"""One Gated DeltaNet layer under context parallelism 2 on 2 CPU ranks: the state-passing chain
(parallel/state_passing.py, the ranks one after another) against the layer by heads
(parallel/context_heads.py: two all-to-alls, both ranks at once), forward + backward.

Hidden 256, 2 key heads and 4 value heads of 64, chunk 64, sequence 2048, batch 1, fp32, one
thread per rank. The same layer (same weights, same input) runs both ways; the outputs and input
gradients of the two are compared first. Then, after one warm-up of each, chain and heads
alternate `--repeats` times (3); each timing is rank 0's wall time of one forward + backward
between two barriers, and each rank's CPU time. The machine is shared (2 cores for 2 ranks and
other work), so wall times carry other people's load; run it twice and compare.

Second, in one process (no load from the other rank): the CPU time of the scans one rank runs
each way, forward + backward (best of 5): by heads, the whole sequence for half of the heads;
on the chain, its two quarter-sequence chunks for all heads, which the chain runs one rank after
the other (its critical path: 2 ranks x that), so the comparison does not hang on the load.

    python -m bench.bench_cp_linear            # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import time

from tests.distributed import run_distributed

SHAPE = dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_chunk_size=64)


def _worker(rank, seq, repeats):
    import torch
    import torch.distributed as dist

    from megazoo.models.init import Initializer
    from megazoo.models.linear_mixers import ParallelGatedDeltaNet
    from megazoo.models.presets import preset
    from megazoo.parallel.context_split import split_sequence
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology

    torch.set_num_threads(1)
    config = preset("qwen3.5-tiny", **SHAPE)
    topo = ParallelTopology.from_config(ParallelConfig(cp=2))
    layer = ParallelGatedDeltaNet(config, topo, Initializer(config), "layers.0.attention.",
                                  None, None)
    assert layer.by_heads
    x_full = torch.randn(seq, 1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    x_local = split_sequence(x_full, 0, 2, rank)

    def step(by_heads: bool):
        layer.by_heads = by_heads
        layer.zero_grad()
        x = x_local.clone().requires_grad_(True)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        y = layer(x)
        y.square().sum().backward()
        dist.barrier()
        return (time.perf_counter() - wall, time.process_time() - cpu, y.detach(),
                x.grad, layer.conv_weight.grad.clone())

    _, _, y_chain, g_chain, w_chain = step(False)
    _, _, y_heads, g_heads, w_heads = step(True)
    diffs = [float((a - b).abs().max()) for a, b in ((y_chain, y_heads), (g_chain, g_heads))]
    dist.all_reduce(w_chain)
    dist.all_reduce(w_heads)
    diffs.append(float((w_chain - w_heads).abs().max()))
    times = {"chain": [], "heads": []}
    for _ in range(repeats):
        for name, flag in (("chain", False), ("heads", True)):
            wall, cpu, *_ = step(flag)
            times[name].append((wall, cpu))
    return diffs, times


def scan_costs(seq: int) -> tuple[float, float]:
    """CPU s of one rank's scans, forward + backward: (by heads, on the chain)."""
    import torch

    from megazoo.models.init import Initializer
    from megazoo.models.linear_mixers import ParallelGatedDeltaNet
    from megazoo.models.presets import preset
    from megazoo.parallel.context_heads import HeadPart
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    torch.set_num_threads(1)
    config = preset("qwen3.5-tiny", **SHAPE)
    layer = ParallelGatedDeltaNet(config, ParallelTopology.from_config(ParallelConfig()),
                                  Initializer(config), "layers.0.attention.", None, None)
    part = HeadPart(0, 2)
    whole = torch.randn(seq, 1, sum(part.width(s) for s in layer.segments if s.groups),
                        requires_grad=True)
    chunks = [torch.randn(seq // 4, 1, layer.in_proj.weight.shape[0], requires_grad=True)
              for _ in range(2)]

    def best(fn):
        times = []
        for _ in range(5):
            cpu = time.process_time()
            fn()
            times.append(time.process_time() - cpu)
        return min(times)

    def heads():
        layer.scan(whole, None, None, part)[0].sum().backward()

    def chain():
        for x in chunks:
            layer.scan(x, None, None)[0].sum().backward()
    return best(heads), best(chain)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = run_distributed(_worker, 2, args.seq, args.repeats, timeout=1200)
    diffs, times = results[0]
    print(f"Gated DeltaNet, hidden 256, seq {args.seq}, cp2 on 2 ranks, forward + backward, fp32")
    print(f"chain vs heads, largest difference: output {diffs[0]:.1e}, input gradient "
          f"{diffs[1]:.1e}, conv weight gradient (summed over ranks) {diffs[2]:.1e}")
    for name in ("chain", "heads"):
        walls = [w for w, _ in times[name]]
        cpus = [[c for _, c in r[1][name]] for r in results]
        print(f"{name}: wall s (rank 0) {', '.join(f'{w:.2f}' for w in walls)}; median "
              f"{statistics.median(walls):.2f}; CPU s per rank (median) "
              f"{', '.join(f'{statistics.median(c):.2f}' for c in cpus)}")
    ratio = statistics.median(w for w, _ in times["chain"]) / \
        statistics.median(w for w, _ in times["heads"])
    print(f"chain / heads, median wall: {ratio:.2f}x")
    heads, chain = scan_costs(args.seq)
    print(f"one rank's scans, CPU s (one process): by heads {heads:.3f}; chain {chain:.3f}, "
          f"critical path 2 x {chain:.3f} = {2 * chain:.3f}; chain path / heads "
          f"{2 * chain / heads:.2f}x")


if __name__ == "__main__":
    main()
