"""Pipeline bubble benchmark: measured step time against the schedule's theory.

Every layer's forward sleeps `--forward-ms` and its backward `--backward-ms`, so the step time
depends on the schedule only, not on how many cores the ranks share (sleeping ranks use none).
With L layers over p ranks and m microbatches, a perfect pipeline would take

    ideal = m * L * (forward + backward) / p

and the schedules are expected to take ideal x (1 + (p-1)/m) (1F1B) and ideal x (1 + (p-1)/(v*m))
(interleaved, v chunks per rank). The benchmark prints both side by side, writes
bench/results/pipeline_bubble.json, the per-rank timelines, and a PNG of the measured schedules.

    python bench/bench_pipeline.py            # p=4, m=8, v=2, L=8, 20/40 ms: ~20 s
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from megazoo.parallel.pipeline.engine import PipelineStats, Timeline, run_pipeline  # noqa: E402
from megazoo.parallel.pipeline.partition import partition  # noqa: E402
from megazoo.parallel.pipeline.schedules import activation_bound, build_schedule  # noqa: E402
from megazoo.parallel.pipeline.simulate import simulate  # noqa: E402
from megazoo.parallel.topology import ParallelConfig, ParallelTopology  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HIDDEN = 16


class _Sleep(torch.autograd.Function):
    """y = x * w, taking a fixed wall time in forward and in backward."""

    @staticmethod
    def forward(ctx, x, w, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.save_for_backward(x, w)
        ctx.backward_s = backward_s
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class SleepChunk(nn.Module):
    def __init__(self, layer_range, pre_process, post_process, forward_s, backward_s):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(1)) for _ in range(*layer_range))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        for w in self.weights:
            x = _Sleep.apply(x, w, self.forward_s, self.backward_s)
        return x


def _forward(chunk, inp, mb):
    out = chunk(mb["x"] if inp is None else inp)
    return out.mean() if chunk.post_process else out


def _bench_worker(rank, runs, args):
    out = []
    for name, vpp in runs:
        topo = ParallelTopology.from_config(ParallelConfig(pp=args.pp, vpp=vpp))
        specs = partition(args.layers, args.pp, vpp)[topo.pp_rank]
        chunks = [SleepChunk(s.layer_range, s.pre_process, s.post_process,
                             args.forward_ms / 1e3, args.backward_ms / 1e3) for s in specs]
        shape = (4, 1, HIDDEN)
        mbs = [{"x": torch.randn(shape)} for _ in range(args.microbatches)]
        steps = build_schedule(name, args.pp, topo.pp_rank, args.microbatches, vpp)
        times, timeline, stats = [], None, None
        for it in range(args.warmup + args.iters):
            timeline, stats = Timeline(rank=topo.pp_rank), PipelineStats()
            dist.barrier()
            start = time.perf_counter()
            run_pipeline(steps, chunks, mbs, topo, shape, torch.float32, _forward,
                         timeline=timeline, stats=stats)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends with the last rank
            if it >= args.warmup:
                times.append(elapsed.item())
        timelines = [None] * dist.get_world_size()
        dist.all_gather_object(timelines, timeline.to_dict())
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, stats.peak_activations)
        out.append(dict(schedule=name, vpp=vpp, step_s=statistics.median(times), times=times,
                        timelines=timelines, peak_activations=peaks))
    return out


def theory(args, name: str, vpp: int, timelines: list[dict]) -> dict:
    p, m = args.pp, args.microbatches
    ideal = m * args.layers * (args.forward_ms + args.backward_ms) / 1e3 / p
    factor = 1 + (p - 1) / (vpp * m)
    # A sleep overshoots by a fraction of a millisecond on busy cores; the same formula on the
    # compute time actually measured separates that from the schedule's own overhead.
    busy = statistics.mean(sum(e[4] - e[3] for e in t["events"]) for t in timelines)
    per_chunk = args.layers / (p * vpp) / 1e3
    simulated = simulate([build_schedule(name, p, r, m, vpp) for r in range(p)], vpp,
                         forward_time=args.forward_ms * per_chunk,
                         backward_time=args.backward_ms * per_chunk).makespan
    return dict(ideal_s=ideal, theory_s=ideal * factor, simulated_s=simulated,
                theory_from_measured_compute_s=busy * factor,
                theory_bubble=(p - 1) / vpp / (m + (p - 1) / vpp))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)

    runs = [("1f1b", 1), ("interleaved", args.vpp)]
    results = run_distributed(_bench_worker, args.pp, runs, args, timeout=600)[0]
    os.makedirs(args.out, exist_ok=True)
    from megazoo.tools.draw_timeline import bubble_fraction, draw  # noqa: PLC0415 - matplotlib only here

    rows, panels = [], []
    for res in results:
        th = theory(args, res["schedule"], res["vpp"], res["timelines"])
        label = f"{res['schedule']} p={args.pp} v={res['vpp']} m={args.microbatches}"
        measured_bubble = bubble_fraction(res["timelines"])
        bounds = [activation_bound(res["schedule"], args.pp, r, args.microbatches, res["vpp"])
                  for r in range(args.pp)]
        rows.append(dict(schedule=res["schedule"], pp=args.pp, vpp=res["vpp"],
                         microbatches=args.microbatches, layers=args.layers,
                         forward_ms=args.forward_ms, backward_ms=args.backward_ms,
                         measured_s=res["step_s"], all_measured_s=res["times"], **th,
                         ratio_to_theory=res["step_s"] / th["theory_s"],
                         ratio_to_theory_from_measured_compute=(
                             res["step_s"] / th["theory_from_measured_compute_s"]),
                         measured_bubble=measured_bubble,
                         peak_activations=res["peak_activations"], activation_bound=bounds))
        panel = dict(title=label, ranks=res["timelines"])
        panels.append(panel)
        with open(os.path.join(args.out, f"pipeline_timeline_{res['schedule']}.json"), "w") as f:
            json.dump(panel, f)
    with open(os.path.join(args.out, "pipeline_bubble.json"), "w") as f:
        json.dump(rows, f, indent=1)
    png = os.path.join(args.out, "pipeline_timeline.png")
    draw(panels, png)

    print(f"{'schedule':<12} {'ideal s':>8} {'theory s':>9} {'simulated':>9} {'measured s':>11} "
          f"{'ratio':>6} {'ratio*':>7} {'bubble th':>10} {'bubble meas':>12}  "
          f"peak act / bound per rank")
    for r in rows:
        print(f"{r['schedule']:<12} {r['ideal_s']:8.3f} {r['theory_s']:9.3f} "
              f"{r['simulated_s']:9.3f} {r['measured_s']:11.3f} {r['ratio_to_theory']:6.3f} "
              f"{r['ratio_to_theory_from_measured_compute']:7.3f} {r['theory_bubble']:10.3f} "
              f"{r['measured_bubble']:12.3f}  {r['peak_activations']} / {r['activation_bound']}")
    print("ratio = measured / theory; ratio* = measured / theory on the measured compute time")
    print(f"interleaved / 1f1b step time: {rows[1]['measured_s'] / rows[0]['measured_s']:.3f}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
