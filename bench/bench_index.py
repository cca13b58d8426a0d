"""Time GPT index building (document, sample, shuffle indices) for 10 million samples.

Synthetic document lengths (1M documents, lognormal, ~1,000 tokens mean), seq_length 1024:
about ten epochs are needed, so the document index holds ~10M entries. The vectorised sample
index is also timed against the plain per-sample loop (a transcription of Megatron's C++) on a
prefix of the samples, and the greedy blending index (a Python loop) on 1M samples.

    python bench/bench_index.py [--samples 10000000] [--out bench/results/data_index.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megazoo.data.blended import build_blending_indices  # noqa: E402
from megazoo.data.gpt_indices import build_document_index, build_sample_index, build_shuffle_index, plan_epochs  # noqa: E402


def loop_sample_index(sizes, doc_idx, seq_length, num_samples):
    """Megatron's per-sample loop (add_extra_token = 1), for the speed comparison only."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    row = offset = 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[row]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                row += 1
                offset = 0
        out[s] = (row, offset)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--loop-samples", type=int, default=200_000)
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "data_index.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    args = p.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            return plot(json.load(f), args.out.removesuffix(".json") + ".png")

    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(6.5, 0.8, size=args.docs), 1, 100_000).astype(np.int32)
    documents = np.arange(args.docs)
    tokens = int(sizes.sum(dtype=np.int64))
    t = {}
    t0 = time.perf_counter()
    plan = plan_epochs(tokens, args.samples, args.seq_length)
    state = np.random.RandomState(1234)
    doc_idx = build_document_index(documents, plan.num_epochs, state, plan.separate_last_epoch)
    t["document_index_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    sample_idx = build_sample_index(sizes, doc_idx, args.seq_length, plan.num_epochs, tokens)
    t["sample_index_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    n = sample_idx.shape[0] - 1
    shuffle = build_shuffle_index(plan.samples_before_last_epoch if plan.separate_last_epoch else n, n, state)
    t["shuffle_index_s"] = time.perf_counter() - t2
    t["total_s"] = time.perf_counter() - t0
    assert n >= args.samples and len(shuffle) == n

    t3 = time.perf_counter()
    ref = loop_sample_index(sizes, doc_idx, args.seq_length, args.loop_samples)
    loop_s = time.perf_counter() - t3
    np.testing.assert_array_equal(ref, sample_idx[: args.loop_samples + 1])
    t4 = time.perf_counter()
    build_blending_indices([0.3, 0.7], args.blend_samples)
    blend_s = time.perf_counter() - t4

    result = {
        "samples_requested": args.samples, "samples_built": int(n), "documents": args.docs,
        "tokens_per_epoch": tokens, "epochs": plan.num_epochs, "document_index_entries": int(len(doc_idx)),
        "seq_length": args.seq_length, **{k: round(v, 3) for k, v in t.items()},
        "loop_sample_index_s_per_million": round(loop_s / args.loop_samples * 1e6, 2),
        "loop_sample_index_extrapolated_s": round(loop_s / args.loop_samples * n, 1),
        "blending_index_s_per_million": round(blend_s / args.blend_samples * 1e6, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out.removesuffix(".json") + ".png")
    for k, v in result.items():
        print(f"{k:40s} {v}")


def plot(result: dict, path: str) -> None:
    """Seconds per index for the vectorised builders, next to Megatron's per-sample loop."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["document_index_s", "sample_index_s", "shuffle_index_s", "total_s",
             "loop_sample_index_extrapolated_s"]
    labels = ["document", "sample", "shuffle", "total", "sample index,\nper-sample loop"]
    values = [result[n] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bars = ax.bar(labels, values, color=["tab:blue"] * 4 + ["tab:gray"])
    for b_, v in zip(bars, values):
        ax.text(b_.get_x() + b_.get_width() / 2, v, f"{v:.1f} s", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    speedup = result["loop_sample_index_extrapolated_s"] / max(result["sample_index_s"], 1e-9)
    ax.set_title(f"GPT indices for {result['samples_built'] / 1e6:.1f}M samples of "
                 f"{result['seq_length']} tokens, {result['documents'] / 1e6:.0f}M documents "
                 f"(sample index {speedup:.0f}x faster than the loop)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
