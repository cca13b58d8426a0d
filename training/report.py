"""A one-page PNG of a run: losses, learning rate, gradient norm, loss scale, throughput, memory
(and for MoE runs the auxiliary losses and the busiest expert's load), with every rollback and
skipped step marked. Reads only the run folder's JSON-lines files."""
from __future__ import annotations

import os

from .journal import JOURNAL, METRICS, read_jsonl

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("loss_scale", "loss scale"), ("tokens_per_s", "tokens/s"), ("mem_gib", "peak memory per rank (GiB)")]
MOE_PANELS = [("moe_aux_loss", "MoE load-balancing loss (apart from the LM loss)"),
              ("moe_max_load", "MoE busiest expert / mean (worst layer)")]


def write_report(run_dir: str, out_path: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(os.path.join(run_dir, METRICS))
    if not rows:
        raise FileNotFoundError(f"{os.path.join(run_dir, METRICS)}: no metrics; is this a megazoo run folder "
                                f"(the --save or --tensorboard-dir of a run)?")
    events = read_jsonl(os.path.join(run_dir, JOURNAL))
    train = [r for r in rows if r["split"] == "train"]
    valid = [r for r in rows if r["split"] == "valid"]
    panels = PANELS + (MOE_PANELS if any("moe_aux_loss" in r for r in train) else [])
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(11, 3 * len(panels) // 2), sharex=True)
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["iteration"], r[key]) for r in train if key in r]
        if pts:
            ax.plot(*zip(*pts), label="train", lw=1.2)
        if key == "loss" and valid:
            ax.plot([r["iteration"] for r in valid], [r["loss"] for r in valid], "o-", label="validation")
            ax.legend()
        for e in events:
            if e["kind"] == "rollback":
                ax.axvline(e["iteration"], color="red", ls="--", lw=1)
            elif e["kind"] in ("spike", "nonfinite"):
                ax.axvline(e["iteration"], color="orange", ls=":", lw=1)
        ax.set_title(title)
        if key in ("loss_scale",) and pts and min(v for _, v in pts) > 0:
            ax.set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    rollbacks = sum(e["kind"] == "rollback" for e in events)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {len(train)} logged steps, "
                 f"{rollbacks} rollbacks (red), unhealthy steps (orange)")
    fig.tight_layout()
    out_path = out_path or os.path.join(run_dir, "report.png")
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
