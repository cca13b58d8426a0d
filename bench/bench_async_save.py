"""--async-save against the synchronous save: how long one save blocks the step loop.

The real trainer (`training/run/trainer.py`, one process, mock data) runs the same model twice
in one process, side by side: once saving synchronously, once with --async-save, a checkpoint
every `--save-interval` iterations into a fresh folder each. The stall of a save is the time
the step loop spends inside the trainer's save call (the copy to host memory and the save's
opening agreements for --async-save; the whole write, fsync and commit for the synchronous
save) plus, for --async-save, the per-iteration commit checks, the commit, and any wait for a write
still running when the next save is due (with a save interval shorter than the write). The
last save of each run is left out of the mean, since the end of the run waits for its write
(that wait is printed apart as the exit wait). Step times are printed too: the background writer shares the
CPU with the step loop, so steps during a write may be slower.

    python -m bench.bench_async_save                   # 370 MB checkpoints, ~4 min on 2 loaded cores
    python -m bench.bench_async_save --hidden 768      # larger

Writes bench/results/async_save.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from megazoo.models.registry import build_model as model_provider
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser
from megazoo.training.run.trainer import Trainer

RESULTS = os.path.join(ROOT, "bench", "results")


def flags(args, save: str, async_save: bool) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
            "--vocab-size", str(args.vocab), "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", str(args.iters),
            "--save", save, "--save-interval", str(args.save_interval), "--log-interval",
            str(args.iters), "--eval-interval", "0", "--seed", "1"] + \
        (["--async-save"] if async_save else [])


def run_one(args, async_save: bool) -> dict:
    """One training run; per save, the seconds the step loop was blocked."""
    save = tempfile.mkdtemp(prefix="bench_async_save_", dir=args.dir)
    try:
        run = to_run_config(build_parser().parse_args(flags(args, save, async_save)), world_size=1)
        trainer = Trainer(model_provider, run)
        stalls, steps, saving = [], [], False
        try:
            while not trainer.done:
                begin = time.perf_counter()
                trainer.step()
                steps.append((time.perf_counter() - begin, saving))
                begin = time.perf_counter()
                trainer.save_if_due(stopping=False)
                if not async_save and trainer.state.iteration % args.save_interval == 0:
                    stalls.append(time.perf_counter() - begin)
                saving = trainer.writer is not None and trainer.writer.in_flight is not None
            begin = time.perf_counter()
            parts = []
            if trainer.writer is not None:
                trainer.writer.wait()
                parts = trainer.writer.saves
                stalls = [p["copied"] + p["polls"] + p["waited"] for p in parts]
            exit_wait = time.perf_counter() - begin
        finally:
            trainer.close()
        folder = ckpt.latest_checkpoint(save)
        nbytes = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        return dict(stalls=stalls, parts=parts, exit_wait=exit_wait, checkpoint_bytes=nbytes,
                    step_s=statistics.median(s for s, _ in steps[1:]),
                    step_s_while_writing=statistics.median([s for s, w in steps if w] or [0.0]),
                    params=trainer.run.model.num_parameters())
    finally:
        shutil.rmtree(save, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--save-interval", type=int, default=15,
                   help="long enough for a background write to end before the next save (as in "
                        "real runs); a shorter one shows the wait for the write as stall")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp dir)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = {mode: run_one(args, mode == "async") for mode in ("sync", "async")}
    mb = results["sync"]["checkpoint_bytes"] / 1e6
    print(f"model {results['sync']['params'] / 1e6:.1f}M parameters, checkpoint {mb:.0f} MB, "
          f"a save every {args.save_interval} iterations, {args.iters // args.save_interval} saves "
          f"per run, {args.threads} thread(s)")
    print(f"{'':8}{'stall per save (s)':>20}{'exit wait (s)':>15}{'step (s)':>10}"
          f"{'step while writing (s)':>24}")
    for mode, r in results.items():
        r["stall_mean"] = statistics.mean(r["stalls"][:-1])
        writing = f"{r['step_s_while_writing']:.3f}" if mode == "async" else "-"
        print(f"{mode:8}{r['stall_mean']:>20.3f}{r['exit_wait']:>15.3f}{r['step_s']:>10.3f}"
              f"{writing:>24}")
    for part in results["async"]["parts"]:
        print(f"  async save of iteration {part['iteration']}: host copy {part['copied']:.3f} s, "
              f"agreements and commit {part['polls']:.3f} s, waiting for the write "
              f"{part['waited']:.3f} s; written in the background in {part['written']:.2f} s")
    ratio = results["sync"]["stall_mean"] / results["async"]["stall_mean"]
    print(f"stall per save, sync / async: {ratio:.1f}x")
    later = {mode: statistics.mean(r["stalls"][1:-1]) for mode, r in results.items()
             if len(r["stalls"]) > 2}
    ratio_later = None
    if len(later) == 2:  # the first async save allocates the host copy; later ones reuse it
        print(f"after the first save (host copy reused): sync {later['sync']:.3f} s, async "
              f"{later['async']:.3f} s per save, {later['sync'] / later['async']:.1f}x")
        ratio_later = later['sync'] / later['async']
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "async_save.json"), "w") as f:
        json.dump(dict(config=vars(args), results=results, stall_ratio=ratio,
                       stall_ratio_after_first=ratio_later,
                       torch=torch.__version__, load_average=[load_before, os.getloadavg()]),
                  f, indent=1)


if __name__ == "__main__":
    main()
