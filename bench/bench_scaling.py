"""Scaling on CPU: step time and per-rank memory as hidden size, layers and world size grow, each
measured in its own spawned gloo world (mock tokens) and set beside the planner's prediction.

Per configuration and rank: the ZeRO optimizer's model-state bytes (`memory_report()`), the
activation bytes autograd kept at the pipeline's peak (`PipelineStats.peak_saved_bytes`), and
peak RSS; per configuration: median step time over the timed steps, in wall-clock seconds and in
CPU seconds per rank. The planner (training/planning/planner.py) predicts model states and activations for
the same layout (flash attention, since the model uses SDPA; no dropout; the planner leaves out
per-token vectors such as norm statistics, so activations land near, not exactly on, the
measurement). Worlds are fp32 unless marked bf16; "sp" marks sequence parallelism.

Every rank runs one thread and the machine has 2 cores, so worlds of 4 are oversubscribed: their
wall time measures contention as much as the model; the CPU time per rank is the comparable one.

    python bench/bench_scaling.py            # ~1.5 min on 2 shared cores
    python bench/bench_scaling.py --quick    # fewer steps
    python bench/bench_scaling.py --table    # docs/planner.md's table from the saved JSON

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
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazoo.models.config import TransformerConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from megazoo.training.planning.planner import (Layout, activation_bytes, memory_per_gpu,  # noqa: E402
                              model_state_bytes, stage_params)

RESULTS = os.path.join(ROOT, "bench", "results")
SEQ, MBS, VOCAB = 128, 2, 4096


class World(NamedTuple):
    """One measured world: model size and layout."""
    sweep: str
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    zero: int
    sp: bool = False
    precision: str = "fp32"  # fp32 | bf16


SWEEPS = [World("hidden", h, 4, 1, 1, 2, 1) for h in (128, 256, 512)] + \
         [World("layers", 256, L, 1, 1, 2, 1) for L in (2, 4, 8)] + \
         [World("world", 256, 4, 1, 1, w, 2) for w in (1, 2, 4)] + \
         [World("world", 256, 4, 2, 1, 1, 0), World("world", 256, 4, 2, 2, 1, 0),
          World("world", 256, 4, 1, 2, 2, 1), World("world", 256, 4, 2, 1, 1, 0, sp=True),
          World("world", 256, 4, 2, 2, 1, 0, sp=True),
          World("world", 256, 4, 2, 1, 1, 0, sp=True, precision="bf16")]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _config(hidden: int, layers: int, precision: str = "fp32") -> TransformerConfig:
    return TransformerConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers,
                             num_attention_heads=max(hidden // 64, 2), max_position_embeddings=SEQ,
                             params_dtype=DTYPES[precision])


def _worker(rank, hidden, layers, tp, pp, microbatches, zero, steps, sp, precision):
    import torch

    from megazoo.models.language_model import TransformerLanguageModel
    from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
    from megazoo.parallel.pipeline.schedules import build_schedule
    from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.run.step import activation_shape, make_forward_fn

    cfg = _config(hidden, layers, precision)
    topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp))
    chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs())
              for s in topo.config.chunk_specs(layers, topo.pp_rank)]
    broadcast_tied_embedding(chunks, topo)
    opt = build_optimizer(chunks, topo, OptimizerConfig(zero_stage=zero, lr=1e-4), cfg.dtype)
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
        # training.run.step.forward_backward + step, with the engine's PipelineStats attached
        with opt.no_sync():
            run_pipeline(build_schedule("1f1b" if pp > 1 else "no_pipelining", pp, topo.pp_rank,
                                        microbatches), chunks, mbs, topo, shape, cfg.dtype,
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


def run_one(w: World, steps: int) -> dict:
    m = 4  # microbatches per DP replica
    hidden, layers, tp, pp, dp, zero = w.hidden, w.layers, w.tp, w.pp, w.dp, w.zero
    ranks = run_distributed(_worker, tp * pp * dp, hidden, layers, tp, pp, m, zero, steps, w.sp,
                            w.precision, timeout=600)
    cfg = _config(hidden, layers, w.precision)
    layout = Layout.of(tp=tp, pp=pp, dp=dp, zero_stage=zero, sequence_parallel=w.sp,
                       micro_batch_size=MBS, global_batch_size=m * MBS * dp, seq_length=SEQ,
                       params_dtype=cfg.params_dtype, flash_attention=True)
    pred_mem = memory_per_gpu(cfg, layout)
    out = dict(w._asdict(), world=tp * pp * dp, params=cfg.num_parameters(),
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


def layout_name(r: dict) -> str:
    sp = " sp" if r.get("sp") else ""
    bf16 = " bf16" if r.get("precision", "fp32") == "bf16" else ""
    return f"tp{r['tp']} pp{r['pp']} dp{r['dp']}{sp} zero{r['zero']}{bf16}"


def table(results: list[dict]) -> str:
    """docs/planner.md's table: one row per distinct rank (the ranks of one stage agree)."""
    lines = ["| layout | h | L | params | rank (stage) | model states MiB: measured / predicted "
             "| error | activations MiB: measured / predicted | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        seen = set()
        for k in r["ranks"]:
            key = (k["stage"], k["model_states"], k["activations"])
            if key in seen:
                continue
            seen.add(key)
            rank = k["stage"] if r["pp"] > 1 else ("any" if r["world"] > 1 else str(k["rank"]))
            lines.append(
                f"| {layout_name(r)} | {r['hidden']} | {r['layers']} | {r['params'] / 1e6:.2f}M | "
                f"{rank} | {k['model_states'] / 2**20:.2f} / {k['predicted_model_states'] / 2**20:.2f} "
                f"| {100 * k['model_state_error']:+.1f}% | {k['activations'] / 2**20:.2f} / "
                f"{k['predicted_activations'] / 2**20:.2f} | {100 * k['activation_error']:+.1f}% |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for col, sweep in enumerate(("hidden", "layers", "world")):
        rows = [r for r in results if r["sweep"] == sweep]
        labels = [f"h{r['hidden']}" if sweep == "hidden" else f"L{r['layers']}" if sweep == "layers"
                  else layout_name(r).replace(" dp", "\ndp") for r in rows]
        x = range(len(rows))
        ax = axes[0][col]
        ax.plot(x, [r["step_cpu_s"] for r in rows], "o-", label="CPU s per rank")
        ax.plot(x, [r["step_wall_s"] for r in rows], "s--", label="wall s")
        ax.set_xticks(list(x), labels, rotation=35, fontsize=7, ha="right")
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
        ax.set_xticks(list(x), labels, rotation=35, fontsize=7, ha="right")
        ax.set_ylabel("MiB per rank (max over ranks)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1 timed step per world")
    p.add_argument("--out", default=os.path.join(RESULTS, "scaling"))
    p.add_argument("--table", action="store_true",
                   help="print the markdown table of the saved OUT.json and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.table:
        with open(args.out + ".json") as f:
            results = json.load(f)["results"]
        print(table(results))
        return results
    steps = 1 if args.quick else args.steps
    results = []
    print(f"{'sweep':6} {'h':>4} {'L':>2} {'layout':>14} {'CPU s':>6} {'wall s':>6} "
          f"{'states MiB':>10} {'planner':>8} {'err':>6} {'activ MiB':>9} {'planner':>8}")
    for w in SWEEPS:
        r = run_one(w, steps)
        results.append(r)
        worst = max(r["ranks"], key=lambda k: abs(k["model_state_error"]))
        big = max(r["ranks"], key=lambda k: k["activations"])
        short = layout_name(r).replace(" ", "").replace("zero", "z")
        print(f"{w.sweep:6} {w.hidden:4} {w.layers:2} {short:>14} "
              f"{r['step_cpu_s']:6.3f} {r['step_wall_s']:6.3f} {worst['model_states'] / 2**20:10.2f} "
              f"{worst['predicted_model_states'] / 2**20:8.2f} {100 * worst['model_state_error']:+5.1f}% "
              f"{big['activations'] / 2**20:9.2f} {big['predicted_activations'] / 2**20:8.2f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"seq": SEQ, "micro_batch": MBS, "vocab": VOCAB, "microbatches": 4,
                   "results": results}, f, indent=1)
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and .png\n\n{table(results)}")
    return results


if __name__ == "__main__":
    main()
