"""A one-page PNG of a run folder: losses, learning rate, gradient norm, loss scale, throughput,
memory, --eval-tasks scores (and for MoE runs the auxiliary losses, the busiest expert's load, each layer's dropped
share and, from the last log, each layer's tokens per expert), with every rollback and skipped step
marked. Reads only the folder's JSON-lines files.

Each run in the folder (a fresh start or a resume, marked by a `"split": "start"` line in
metrics.jsonl) is drawn in its own colour, so a rerun or a resumed segment stays distinguishable.
The x axis counts iterations; a second axis on top of the first row counts the tokens trained on
(from the logged `tokens`, or the consumed samples for metrics written before it was logged).
A quantity that never changes (the loss scale of an fp32 run, the dropped share of a dropless
MoE, a constant learning rate) gets no panel: its value is named under the title instead.
"""
from __future__ import annotations

import os

from megazoo.training.monitor.journal import JOURNAL, METRICS, read_jsonl

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("loss_scale", "loss scale"), ("tokens_per_s", "tokens/s"), ("mem_gib", "peak memory per rank (GiB)")]
MOE_PANELS = [("moe_aux_loss", "MoE load-balancing loss (apart from the LM loss)"),
              ("moe_max_load", "MoE busiest expert / mean (worst layer)")]
FROM_ZERO = {"mem_gib"}  # panels whose y axis starts at zero
DROPPED = "MoE dropped share of assignments, per layer"


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


def _train_values(runs, key: str) -> list:
    return [r[key] for rows in runs for r in rows if r["split"] == "train" and key in r]


def _flat(values: list) -> bool:
    return len(set(values)) == 1


def choose_panels(runs: list[list[dict]], moe_rows: list[dict]) -> tuple[list, bool, list[str]]:
    """(time panels to draw, whether the dropped-share panel is drawn, what was left out as
    constant, e.g. "loss scale 1"). The loss is always drawn."""
    moe = any("moe_aux_loss" in r for rows in runs for r in rows if r["split"] == "train")
    panels, constant = [], []
    for key, title in PANELS + (MOE_PANELS if moe else []):
        values = _train_values(runs, key)
        if key != "loss" and not values:
            continue
        if key != "loss" and _flat(values):
            constant.append(f"{title} {values[0]:.4g}")
            continue
        panels.append((key, title))
    dropped = [v for r in moe_rows for k, v in r.items() if k.endswith("_dropped")]
    if dropped and _flat(dropped):
        constant.append(f"MoE dropped share {dropped[0]:.4g} in every layer")
    return panels, bool(moe_rows) and not (dropped and _flat(dropped)), constant


def token_axis(runs: list[list[dict]]):
    """(label, iteration -> count, count -> iteration) for the second x axis, or None when the
    metrics give no increasing count (reruns with other batch sizes)."""
    for key, label in (("tokens", "tokens"), ("consumed_samples", "samples")):
        pts = sorted({(r["iteration"], r[key]) for rows in runs for r in rows
                      if r["split"] == "train" and key in r and r[key] is not None})
        its, counts = [0] + [p[0] for p in pts], [0] + [p[1] for p in pts]
        if len(pts) and all(b[0] > a[0] and b[1] > a[1] for a, b in zip(pts, pts[1:])) \
                and pts[0][0] > 0 and pts[0][1] > 0:
            return label, _line_through(its, counts), _line_through(counts, its)
    return None


def _line_through(xs: list, ys: list):
    """The piecewise-linear map through (xs, ys), continued past both ends at the end slopes."""
    import numpy as np
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    first, last = (ys[1] - ys[0]) / (xs[1] - xs[0]), (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def f(x):
        x = np.asarray(x, float)
        y = np.interp(x, xs, ys)
        y = np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * last, y)
        return np.where(x < xs[0], ys[0] + (x - xs[0]) * first, y)
    return f


def draw_report(run_dir: str):
    """The report's matplotlib figure (`write_report` saves it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = run_segments(read_jsonl(os.path.join(run_dir, METRICS)))
    if not runs:
        raise FileNotFoundError(f"{os.path.join(run_dir, METRICS)}: no metrics; is this a megazoo run folder "
                                f"(the --save or --tensorboard-dir of a run)?")
    events = read_jsonl(os.path.join(run_dir, JOURNAL))
    moe_rows = [r for rows in runs for r in rows if r["split"] == "moe"]
    panels, dropped_panel, constant = choose_panels(runs, moe_rows)
    per_layer = (1 if moe_rows else 0) + dropped_panel  # the heatmap, the dropped share
    task_rows = [r for rows in runs for r in rows if r["split"] == "eval_tasks"]
    cells = len(panels) + per_layer + bool(task_rows)
    rows_n = (cells + 1) // 2
    fig, axes = plt.subplots(rows_n, 2, figsize=(11, 3.1 * rows_n + 0.6), layout="constrained",
                             squeeze=False)
    flat_axes = list(axes.flat)
    time_axes = flat_axes[:len(panels) + dropped_panel]
    for ax in time_axes[1:]:
        ax.sharex(time_axes[0])
    for ax in flat_axes[cells:]:
        ax.set_visible(False)
    if moe_rows:
        draw_moe_layers(moe_rows, flat_axes[len(panels)] if dropped_panel else None,
                        flat_axes[cells - 1], fig)
    if task_rows:
        draw_task_scores(task_rows, flat_axes[len(panels) + dropped_panel])
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(flat_axes, panels):
        for k, rows in enumerate(runs):
            colour, name = colours[k % len(colours)], f"run {k + 1} " if len(runs) > 1 else ""
            pts = [(r["iteration"], r[key]) for r in rows if r["split"] == "train" and key in r]
            if pts:  # markers: a short run's single point stays visible
                ax.plot(*zip(*pts), ".-", color=colour, label=f"{name}train", lw=1.2, ms=3)
            sets = sorted({r["split"] for r in rows if r["split"].split("-")[0] == "valid"})
            for split, marker in zip(sets, "osv^D" * len(sets)):  # valid-0, valid-1: one each
                valid = [(r["iteration"], r["loss"]) for r in rows if r["split"] == split and "loss" in r]
                if key == "loss" and valid:
                    ax.plot(*zip(*valid), marker + "--", color=colour, ms=4,
                            label=f"{name}{'validation' if split == 'valid' else split}")
        if key == "loss":
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        values = _train_values(runs, key)
        if key == "loss_scale" and values and min(values) > 0:
            ax.set_yscale("log")
        if key in FROM_ZERO and values and min(values) >= 0:
            ax.set_ylim(bottom=0)  # a 3% change in memory is not drawn as a cliff
    for ax in time_axes:
        for e in events:
            if e["kind"] == "rollback":
                ax.axvline(e["iteration"], color="red", ls="--", lw=1)
            elif e["kind"] in ("spike", "nonfinite"):
                ax.axvline(e["iteration"], color="orange", ls=":", lw=1)
    bottom = {}
    for ax in time_axes:  # the lowest time panel of each column carries the iteration label
        col = flat_axes.index(ax) % 2
        bottom[col] = ax
    for ax in bottom.values():
        ax.set_xlabel("iteration")
    tokens = token_axis(runs)
    if tokens:
        label, forward, inverse = tokens
        from matplotlib.ticker import EngFormatter
        for ax in time_axes[:2]:
            top = ax.secondary_xaxis("top", functions=(forward, inverse))
            top.set_xlabel(label, fontsize=8)
            top.xaxis.set_major_formatter(EngFormatter(sep=""))
    rollbacks = sum(e["kind"] == "rollback" for e in events)
    logged = sum(r["split"] == "train" for rows in runs for r in rows)
    title = (f"{os.path.basename(os.path.abspath(run_dir))}: {len(runs)} run(s), {logged} logged "
             f"steps, {rollbacks} rollbacks (red), unhealthy steps (orange)")
    if constant:
        title += "\nconstant, not drawn: " + ", ".join(constant)
    fig.suptitle(title, fontsize=11)
    return fig


def write_report(run_dir: str, out_path: str | None = None) -> str:
    import matplotlib.pyplot as plt
    fig = draw_report(run_dir)
    out_path = out_path or os.path.join(run_dir, "report.png")
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path


def draw_task_scores(rows: list[dict], ax) -> None:
    """--eval-tasks: each task metric over iterations, the seconds each evaluation took named."""
    keys = sorted({k for r in rows for k in r if "/" in k and isinstance(r[k], (int, float))})
    for key in keys:
        pts = [(r["iteration"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*pts), "o-", label=key, ms=4, lw=1)
    if keys:
        ax.legend(fontsize=7)
    seconds = [r["seconds"] for r in rows if "seconds" in r]
    took = f" ({min(seconds):.1f}-{max(seconds):.1f} s each)" if seconds else ""
    ax.set_title(f"downstream tasks (lm-eval){took}", fontsize=10)
    ax.set_xlabel("iteration")


def draw_moe_layers(rows: list[dict], dropped_ax, tokens_ax, fig) -> None:
    """Each MoE layer's share of dropped assignments over the iterations (when any varies), and
    each layer's share of assignments per expert at the last log (a balanced router shows one
    flat colour)."""
    last = rows[-1]
    layers = sorted(int(k[5:-len("_tokens_per_expert")]) for k in last if k.endswith("_tokens_per_expert"))
    if dropped_ax is not None:
        for i in layers:
            pts = [(r["iteration"], r[f"layer{i}_dropped"]) for r in rows if f"layer{i}_dropped" in r]
            if pts:
                dropped_ax.plot(*zip(*pts), ".-", lw=1, ms=3, label=f"layer {i}")
        if len(layers) <= 8:
            dropped_ax.legend(fontsize=7)
        dropped_ax.set_title(DROPPED, fontsize=10)
    shares = [last[f"layer{i}_tokens_per_expert"] for i in layers]
    image = tokens_ax.imshow(shares, aspect="auto", cmap="viridis", interpolation="nearest")
    tokens_ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    if shares and len(shares[0]) <= 32:
        tokens_ax.set_xticks(range(len(shares[0])))
    tokens_ax.set_xlabel("expert")
    tokens_ax.set_ylabel("layer")
    tokens_ax.set_title(f"MoE share of assignments per expert (iteration {last['iteration']})",
                        fontsize=10)
    fig.colorbar(image, ax=tokens_ax)
