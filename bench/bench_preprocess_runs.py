"""Measuring one preprocessing run as a process tree (wall, peak RSS, CPU), and the bar chart of
bench/bench_preprocess.py's results."""
from __future__ import annotations

import os
import resource
import subprocess
import time


def tree_rss_kb(pid: int) -> int:
    """Sum of VmRSS over a process and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_measured(cmd: list[str], cwd: str, env: dict | None = None) -> tuple[float, float, str, float]:
    """(wall seconds, peak tree RSS in MB, output, CPU seconds of the whole tree) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kb(proc.pid))
        time.sleep(0.02)
    out = proc.stdout.read()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes reaped pool workers
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, peak / 1024, out, cpu


def plot(results: dict, path: str) -> None:
    """MB/s of every method per worker count; ours first in each group, with its ratios."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {(r["method"], r["workers"]): r for r in results["runs"]}
    methods = list(dict.fromkeys(m for m, _ in runs))
    workers = sorted({w for _, w in runs})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, method in enumerate(methods):
        xs = [i + width * k for i, w in enumerate(workers) if (method, w) in runs]
        ax.bar(xs, [runs[(method, w)]["mb_per_s"] for w in workers if (method, w) in runs], width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workers))], [f"{w} worker(s)" for w in workers])
    ax.set_ylabel("MB of jsonl per second (wall)")
    ax.set_title(f"tokenize + index {results['corpus']['jsonl_mb']} MB of text, GPT-2 BPE", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
