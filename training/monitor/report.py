"""A one-page PNG of a run folder: losses, learning rate, gradient norm, loss scale, throughput,
memory (and for MoE runs the auxiliary losses, the busiest expert's load, each layer's dropped
share and, from the last log, each layer's tokens per expert), with every rollback and skipped step
marked. Reads only the folder's JSON-lines files.

Each run in the folder (a fresh start or a resume, marked by a `"split": "start"` line in
metrics.jsonl) is drawn in its own colour, so a rerun or a resumed segment stays distinguishable.
"""
from __future__ import annotations

import os

from training.monitor.journal import JOURNAL, METRICS, read_jsonl

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("loss_scale", "loss scale"), ("tokens_per_s", "tokens/s"), ("mem_gib", "peak memory per rank (GiB)")]
MOE_PANELS = [("moe_aux_loss", "MoE load-balancing loss (apart from the LM loss)"),
              ("moe_max_load", "MoE busiest expert / mean (worst layer)")]


def run_segments(rows: list[dict]) -> list[list[dict]]:
    """The metrics rows split at each run's start line (files without start lines: one run)."""
    runs: list[list[dict]] = [[]]
    for r in rows:
        if r["split"] == "start":
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(r)
    return [r for r in runs if r]


def write_report(run_dir: str, out_path: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = run_segments(read_jsonl(os.path.join(run_dir, METRICS)))
    if not runs:
        raise FileNotFoundError(f"{os.path.join(run_dir, METRICS)}: no metrics; is this a megazoo run folder "
                                f"(the --save or --tensorboard-dir of a run)?")
    events = read_jsonl(os.path.join(run_dir, JOURNAL))
    moe = any("moe_aux_loss" in r for rows in runs for r in rows if r["split"] == "train")
    moe_rows = [r for rows in runs for r in rows if r["split"] == "moe"]
    panels = PANELS + (MOE_PANELS if moe else [])
    per_layer = 2 if moe_rows else 0
    fig, axes = plt.subplots((len(panels) + per_layer) // 2, 2,
                             figsize=(11, 3 * ((len(panels) + per_layer) // 2)))
    for ax in axes.flat[1:len(panels) + min(per_layer, 1)]:  # time axes; the heatmap is last
        ax.sharex(axes.flat[0])
    if per_layer:
        draw_moe_layers(moe_rows, axes.flat[len(panels)], axes.flat[len(panels) + 1], fig)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.flat, panels):
        for k, rows in enumerate(runs):
            colour, name = colours[k % len(colours)], f"run {k + 1} " if len(runs) > 1 else ""
            pts = [(r["iteration"], r[key]) for r in rows if r["split"] == "train" and key in r]
            if pts:  # markers: a short run's single point stays visible
                ax.plot(*zip(*pts), ".-", color=colour, label=f"{name}train", lw=1.2, ms=3)
            valid = [(r["iteration"], r["loss"]) for r in rows if r["split"] == "valid"]
            if key == "loss" and valid:
                ax.plot(*zip(*valid), "o--", color=colour, label=f"{name}validation", ms=4)
        if key == "loss":
            ax.legend(fontsize=8)
        for e in events:
            if e["kind"] == "rollback":
                ax.axvline(e["iteration"], color="red", ls="--", lw=1)
            elif e["kind"] in ("spike", "nonfinite"):
                ax.axvline(e["iteration"], color="orange", ls=":", lw=1)
        ax.set_title(title)
        values = [r[key] for rows in runs for r in rows if r["split"] == "train" and key in r]
        if key == "loss_scale" and values and min(values) > 0:
            ax.set_yscale("log")
    for ax in axes[-1][:1 if per_layer else 2]:
        ax.set_xlabel("iteration")
    rollbacks = sum(e["kind"] == "rollback" for e in events)
    logged = sum(r["split"] == "train" for rows in runs for r in rows)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {len(runs)} run(s), {logged} logged steps, "
                 f"{rollbacks} rollbacks (red), unhealthy steps (orange)")
    fig.tight_layout()
    out_path = out_path or os.path.join(run_dir, "report.png")
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path


def draw_moe_layers(rows: list[dict], dropped_ax, tokens_ax, fig) -> None:
    """Each MoE layer's share of dropped assignments over the iterations, and each layer's share
    of assignments per expert at the last log (a balanced router shows one flat colour)."""
    last = rows[-1]
    layers = sorted(int(k[5:-len("_tokens_per_expert")]) for k in last if k.endswith("_tokens_per_expert"))
    for i in layers:
        pts = [(r["iteration"], r[f"layer{i}_dropped"]) for r in rows if f"layer{i}_dropped" in r]
        dropped_ax.plot(*zip(*pts), ".-", lw=1, ms=3, label=f"layer {i}")
    if len(layers) <= 8:
        dropped_ax.legend(fontsize=7)
    dropped_ax.set_title("MoE dropped share of assignments, per layer")
    shares = [last[f"layer{i}_tokens_per_expert"] for i in layers]
    image = tokens_ax.imshow(shares, aspect="auto", cmap="viridis", interpolation="nearest")
    tokens_ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    tokens_ax.set_xlabel("expert")
    tokens_ax.set_ylabel("layer")
    tokens_ax.set_title(f"MoE share of assignments per expert (iteration {last['iteration']})")
    fig.colorbar(image, ax=tokens_ax)
