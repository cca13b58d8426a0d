"""Measuring one preprocessing run as a process tree (wall, peak RSS, CPU), the CPU time of each
stage of the work in one process, and the bar chart of bench/bench_preprocess.py's results."""
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


def profile_stages(jsonl: str, vocab: str, merges: str, out_dir: str) -> dict:
    """CPU seconds of each stage of tools/preprocess_data.py's work on `jsonl`, in this process
    (one worker's share is this divided by the workers): where the time goes."""
    import numpy as np
    from tokenizers import Tokenizer, models

    from megazoo.data.indexed import IndexedDatasetBuilder
    from megazoo.data.text_sources import parse_record
    from megazoo.data.tokenizers import build_tokenizer

    def timed(fn):
        t0 = time.process_time()
        value = fn()
        return value, round(time.process_time() - t0, 2)

    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    stages = {}
    lines, stages["read lines"] = timed(lambda: open(jsonl, "rb").readlines())
    texts, stages["parse + validate json"] = timed(
        lambda: [parse_record(("json", jsonl, i + 1, raw), ["text"])[0]["text"] for i, raw in enumerate(lines)])
    encodings, stages["rust encode_batch_fast"] = timed(lambda: tok._tok.encode_batch_fast(texts, add_special_tokens=False))
    ids, stages["encodings -> lists of ids"] = timed(lambda: [e.ids for e in encodings])
    flat, stages["lists -> one int32 array"] = timed(
        lambda: np.concatenate([np.asarray(d, dtype=np.int32) for d in ids]))
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))

    def write():
        b = IndexedDatasetBuilder(os.path.join(out_dir, "profile.bin"), dtype=np.uint16)
        b.add_documents(flat, lengths)
        b.finalize(os.path.join(out_dir, "profile.idx"))

    stages["write .bin + .idx"] = timed(write)[1]
    # The pre-tokenizer alone (GPT-2's regex + byte mapping), with a one-word model: the part of
    # the Rust time that is not BPE merging.
    pre = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    pre.pre_tokenizer = tok._tok.pre_tokenizer
    stages["of the rust time: pre-tokenizer alone"] = timed(lambda: pre.encode_batch_fast(texts, add_special_tokens=False))[1]
    stages["all stages"] = round(sum(v for k, v in stages.items() if not k.startswith("of ")), 2)
    return stages
