"""--compile against eager, per family, side by side in one process: the same tiny-to-small model
(the family's preset shape shrunk to --hidden / --layers), the same data, one training step after
another; prints each side's median step time after the compiled side's warm-up, the ratio, and
the largest relative loss difference (the compiled run must train the eager run's losses).

    python -m bench.bench_compile                         # gpt2, llama, qwen3, mixtral: fp32
    python -m bench.bench_compile --families llama --dtype bf16 --steps 8

Writes bench/results/compile.json. Compile time (the first steps) is reported apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megazoo.models.registry import build_model
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser
from megazoo.training.run.compile import graph_breaks
from megazoo.training.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {"gpt2": "gpt2", "llama": "smollm2-135m", "qwen3": "qwen3-0.6b", "mixtral": "moe-tiny"}


def run(family: str, args, compiled: bool) -> dict:
    argv = ["--model", PRESETS[family], "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--num-attention-heads", "8", "--ffn-hidden-size", str(4 * args.hidden),
            "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
            "--vocab-size", "4096", "--mock-data", "--train-iters", str(args.steps),
            "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
            "--log-interval", "1000", "--eval-interval", "0"]
    if family in ("llama", "qwen3"):
        argv += ["--num-query-groups", "4"]
    if args.dtype == "bf16":
        argv.append("--bf16")
    if compiled:
        argv.append("--compile")
    trainer = Trainer(build_model, to_run_config(build_parser().parse_args(argv), world_size=1))
    times = []
    try:
        while not trainer.done:
            start = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - start)
    finally:
        trainer.close()
    return dict(losses=trainer.result.losses, first_s=sum(times[:2]), step_s=statistics.median(times[2:]),
                breaks_per_layer=trainer.graph_breaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    rows = {}
    for family in args.families:
        eager = run(family, args, compiled=False)
        before = sum(graph_breaks().values())
        compiled = run(family, args, compiled=True)
        diff = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"]))
        rows[family] = dict(eager_step_s=eager["step_s"], compiled_step_s=compiled["step_s"],
                            speedup=eager["step_s"] / compiled["step_s"],
                            compile_s=compiled["first_s"], loss_rel_diff=diff,
                            graph_breaks=sum(graph_breaks().values()) - before,
                            graph_breaks_per_layer=compiled["breaks_per_layer"])
        r = rows[family]
        print(f"{family} {args.dtype}: eager {1e3 * r['eager_step_s']:.1f} ms/step, compiled "
              f"{1e3 * r['compiled_step_s']:.1f} ms/step ({r['speedup']:.2f}x; compile "
              f"{r['compile_s']:.0f} s, {r['graph_breaks']} graph breaks); losses within "
              f"{diff:.1e}", flush=True)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "compile.json"), "w") as f:
        json.dump(dict(args=vars(args), threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
