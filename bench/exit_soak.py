"""Exit soak: N consecutive multi-process trainings under torchrun must all exit 0.

    python -m bench.exit_soak --runs 30 [--nproc 4]

Each run trains a tiny GPT for a few iterations with a checkpoint and the report, then ends; a run
counts as clean when torchrun exits 0 and no rank printed `terminate called` (the abort that an
undestroyed process group can cause at interpreter exit). Prints one line per run and the counts;
exits 1 if any run was not clean. Not part of the test suite (about 8 s per run on 2 cores).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tests.distributed import free_port

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "2", "--save-interval", "2"]


def one_run(nproc: int, tp: int) -> tuple[int, str, float]:
    with tempfile.TemporaryDirectory() as save:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), os.path.join(REPO, "train_gpt.py"), *TINY,
               "--tensor-model-parallel-size", str(tp), "--save", save]
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
        return out.returncode, out.stdout + out.stderr, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="consecutive trainings")
    ap.add_argument("--nproc", type=int, default=2, help="processes per training")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (dp = nproc / tp)")
    a = ap.parse_args(argv)
    clean = 0
    for i in range(1, a.runs + 1):
        rc, log, seconds = one_run(a.nproc, a.tp)
        aborted = "terminate called" in log
        ok = rc == 0 and not aborted
        clean += ok
        print(f"run {i}/{a.runs}: exit {rc}{' (terminate called)' if aborted else ''} in {seconds:.1f} s",
              flush=True)
        if not ok:
            print(log[-3000:], flush=True)
    print(f"{clean} of {a.runs} trainings ({a.nproc} processes each) exited 0 cleanly")
    return 0 if clean == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
