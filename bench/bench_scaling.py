"""Scaling on CPU: step time and per-rank memory as hidden size, layers and world size grow, each
measured in its own spawned gloo world (mock tokens) and set beside the planner's prediction.

Per configuration and rank: the ZeRO optimizer's model-state bytes (`memory_report()`), the
activation bytes autograd kept at the pipeline's peak (`PipelineStats.peak_saved_bytes`), and
peak RSS; per configuration: median step time over the timed steps, in wall-clock seconds and in
CPU seconds per rank. The planner (training/planner.py) predicts model states and activations for
the same layout (fp32, flash attention since the model uses SDPA; its activation formula counts
two dropout masks per layer that a dropout-free model does not keep, and it ignores small
tensors, so activations are expected near, not exactly on, the measurement).

Every rank runs one thread and the machine has 2 cores, so worlds of 4 are oversubscribed: their
wall time measures contention as much as the model; the CPU time per rank is the comparable one.

    python bench/bench_scaling.py            # ~4-5 min on 2 shared cores
    python bench/bench_scaling.py --quick    # fewer steps

Writes bench/results/scaling.json and scaling.png.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models.config import TransformerConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from training.planner import (Layout, activation_bytes, memory_per_gpu,  # noqa: E402
                              model_state_bytes, stage_params)

RESULTS = os.path.join(ROOT, "bench", "results")
SEQ, MBS, VOCAB = 128, 2, 4096

# (sweep, hidden, layers, tp, pp, dp, zero): one world each
SWEEPS = [("hidden", h, 4, 1, 1, 2, 1) for h in (128, 256, 512)] + \
         [("layers", 256, L, 1, 1, 2, 1) for L in (2, 4, 8)] + \
         [("world", 256, 4, 1, 1, w, 2) for w in (1, 2, 4)] + \
         [("world", 256, 4, 2, 1, 1, 0), ("world", 256, 4, 2, 2, 1, 0), ("world", 256, 4, 1, 2, 2, 1)]


def _config(hidden: int, layers: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers,
                             num_attention_heads=max(hidden // 64, 2), max_position_embeddings=SEQ)


def _worker(rank, hidden, layers, tp, pp, microbatches, zero, steps):
    import torch

    from models.language_model import TransformerLanguageModel
    from parallel.pipeline.engine import PipelineStats, run_pipeline
    from parallel.pipeline.partition import rank_chunks
    from parallel.pipeline.schedules import build_schedule
    from parallel.pipeline.tied import broadcast_tied_embedding
    from parallel.topology import ParallelConfig, ParallelTopology
    from parallel.zero import OptimizerConfig, build_optimizer
    from training.step import activation_shape, make_forward_fn

    cfg = _config(hidden, layers)
    topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp))
    chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs())
              for s in rank_chunks(layers, pp, 1, topo.pp_rank)]
    broadcast_tied_embedding(chunks, topo)
    opt = build_optimizer(chunks, topo, OptimizerConfig(zero_stage=zero, lr=1e-4))
    g = torch.Generator().manual_seed(1000 + topo.dp_rank)

    def batch():
        out = []
        for _ in range(microbatches):
            t = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
            out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()})
        return out
    shape = activation_shape(topo, SEQ, MBS, hidden)
    stats = PipelineStats()
    wall, cpu = [], []
    for step in range(steps + 1):  # step 0 warms up
        mbs = batch()
        torch.distributed.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        # training.step.forward_backward + step, with the engine's PipelineStats attached
        with opt.no_sync():
            run_pipeline(build_schedule("1f1b" if pp > 1 else "no_pipelining", pp, topo.pp_rank,
                                        microbatches), chunks, mbs, topo, shape, torch.float32,
                         make_forward_fn(), stats=stats)
        opt.grad_sync.launch_remaining()
        opt.step()
        opt.zero_grad()
        torch.distributed.barrier()
        if step:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    rep = opt.memory_report()
    return dict(rank=rank, stage="only" if pp == 1 else ("first" if topo.is_first_stage else "last"),
                model_states=rep["model_states"], numel=rep["numel"],
                activations=stats.peak_saved_bytes, wall=wall, cpu=cpu,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run_one(sweep, hidden, layers, tp, pp, dp, zero, steps) -> dict:
    m = 4  # microbatches per DP replica
    ranks = run_distributed(_worker, tp * pp * dp, hidden, layers, tp, pp, m, zero, steps,
                            timeout=600)
    cfg = _config(hidden, layers)
    layout = Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=MBS, global_batch=m * MBS * dp,
                    seq_length=SEQ, precision="fp32", flash_attention=True)
    pred_mem = memory_per_gpu(cfg, layout)
    out = dict(sweep=sweep, hidden=hidden, layers=layers, tp=tp, pp=pp, dp=dp, zero=zero,
               world=tp * pp * dp, params=cfg.num_parameters(),
               step_wall_s=statistics.median(r["wall"][i] for r in ranks for i in range(len(r["wall"]))),
               step_cpu_s=statistics.median(r["cpu"][i] for r in ranks for i in range(len(r["cpu"]))),
               tokens_per_step=m * MBS * SEQ * dp, ranks=[])
    for r in ranks:
        pred_states = sum(model_state_bytes(stage_params(cfg, tp, pp, r["stage"]), layout))
        pred_act = activation_bytes(cfg, layout, r["stage"])
        out["ranks"].append(dict(r, predicted_model_states=pred_states,
                                 predicted_activations=pred_act,
                                 model_state_error=pred_states / r["model_states"] - 1,
                                 activation_error=pred_act / max(r["activations"], 1) - 1))
    out["predicted_peak_total"] = pred_mem.total
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for col, sweep in enumerate(("hidden", "layers", "world")):
        rows = [r for r in results if r["sweep"] == sweep]
        labels = [f"h{r['hidden']}" if sweep == "hidden" else f"L{r['layers']}" if sweep == "layers"
                  else f"tp{r['tp']}pp{r['pp']}dp{r['dp']} z{r['zero']}" for r in rows]
        x = range(len(rows))
        ax = axes[0][col]
        ax.plot(x, [r["step_cpu_s"] for r in rows], "o-", label="CPU s per rank")
        ax.plot(x, [r["step_wall_s"] for r in rows], "s--", label="wall s")
        ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
        ax.set_title(f"step time vs {sweep}")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        meas = [max(k["model_states"] for k in r["ranks"]) / 2**20 for r in rows]
        pred = [max(k["predicted_model_states"] for k in r["ranks"]) / 2**20 for r in rows]
        act = [max(k["activations"] for k in r["ranks"]) / 2**20 for r in rows]
        pact = [max(k["predicted_activations"] for k in r["ranks"]) / 2**20 for r in rows]
        ax.plot(x, meas, "o-", label="model states, measured")
        ax.plot(x, pred, "x:", label="model states, planner")
        ax.plot(x, act, "o-", label="activations, measured")
        ax.plot(x, pact, "x:", label="activations, planner")
        ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
        ax.set_ylabel("MiB per rank (max over ranks)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1 timed step per world")
    p.add_argument("--out", default=os.path.join(RESULTS, "scaling"))
    args = p.parse_args(argv)
    steps = 1 if args.quick else args.steps
    results = []
    print(f"{'sweep':6} {'h':>4} {'L':>2} {'layout':>14} {'CPU s':>6} {'wall s':>6} "
          f"{'states MiB':>10} {'planner':>8} {'err':>6} {'activ MiB':>9} {'planner':>8}")
    for sweep, hidden, layers, tp, pp, dp, zero in SWEEPS:
        r = run_one(sweep, hidden, layers, tp, pp, dp, zero, steps)
        results.append(r)
        worst = max(r["ranks"], key=lambda k: abs(k["model_state_error"]))
        big = max(r["ranks"], key=lambda k: k["activations"])
        print(f"{sweep:6} {hidden:4} {layers:2} {f'tp{tp}pp{pp}dp{dp}z{zero}':>14} "
              f"{r['step_cpu_s']:6.3f} {r['step_wall_s']:6.3f} {worst['model_states'] / 2**20:10.2f} "
              f"{worst['predicted_model_states'] / 2**20:8.2f} {100 * worst['model_state_error']:+5.1f}% "
              f"{big['activations'] / 2**20:9.2f} {big['predicted_activations'] / 2**20:8.2f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"seq": SEQ, "micro_batch": MBS, "vocab": VOCAB, "microbatches": 4,
                   "results": results}, f, indent=1)
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and .png")
    return results


if __name__ == "__main__":
    main()
