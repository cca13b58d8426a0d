"""Draw a measured pipeline schedule: one row per rank, a box per forward/backward.

Input: JSON written by the pipeline benchmark (or any run that kept `engine.Timeline`s):

    {"title": "...", "ranks": [{"rank": 0, "events": [["F", mb, chunk, start, end], ...]}, ...]}

Forwards are light, backwards dark; the colour follows the virtual chunk; each box is labelled
with its microbatch. The bubble fraction (the share of rank-time not spent computing between the
first start and the last end) is printed and written in the panel title.

    python tools/draw_timeline.py bench/results/pipeline_timeline_1f1b.json [...] -o out.png
"""
from __future__ import annotations

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt

# Chunk colours (forward shade, backward shade).
_COLOURS = [("#9ecae1", "#2171b5"), ("#a1d99b", "#238b45"), ("#fdae6b", "#d94801"),
            ("#bcbddc", "#6a51a3")]


def bubble_fraction(ranks: list[dict]) -> float:
    """1 - busy / (ranks x span), span from the earliest start to the latest end."""
    events = [e for r in ranks for e in r["events"]]
    start, end = min(e[3] for e in events), max(e[4] for e in events)
    busy = sum(e[4] - e[3] for e in events)
    return 1.0 - busy / (len(ranks) * (end - start))


def draw_panel(ax, timeline: dict) -> float:
    ranks = sorted(timeline["ranks"], key=lambda r: r["rank"])
    t0 = min(e[3] for r in ranks for e in r["events"])
    for row, r in enumerate(ranks):
        for kind, mb, chunk, start, end in r["events"]:
            colour = _COLOURS[chunk % len(_COLOURS)][kind == "B"]
            left, width = (start - t0) * 1e3, (end - start) * 1e3
            ax.barh(row, width, left=left, height=0.8, color=colour, edgecolor="black",
                    linewidth=0.4)
            ax.text(left + width / 2, row, str(mb), ha="center", va="center", fontsize=7,
                    color="white" if kind == "B" else "black")
    bubble = bubble_fraction(ranks)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()  # rank 0 on top, as pipeline diagrams are drawn
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{timeline.get('title', '')}   bubble {bubble:.1%}", fontsize=9)
    return bubble


def draw(timelines: list[dict], png: str) -> list[float]:
    """One panel per timeline, stacked; returns their bubble fractions."""
    fig, axes = plt.subplots(len(timelines), 1, squeeze=False,
                             figsize=(12, 1.0 + 0.55 * sum(len(t["ranks"]) for t in timelines)
                                      + 0.6 * len(timelines)))
    bubbles = [draw_panel(ax, t) for ax, t in zip(axes[:, 0], timelines)]
    # Same time axis for every panel so schedules compare by eye.
    right = max(ax.get_xlim()[1] for ax in axes[:, 0])
    for ax in axes[:, 0]:
        ax.set_xlim(0, right)
    fig.text(0.01, 0.005, "light: forward, dark: backward; colour: virtual chunk; "
             "label: microbatch", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return bubbles


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timelines", nargs="+", help="timeline JSON files")
    parser.add_argument("-o", "--output", default="pipeline_timeline.png")
    args = parser.parse_args(argv)
    timelines = []
    for path in args.timelines:
        with open(path) as f:
            timelines.append(json.load(f))
    for t, bubble in zip(timelines, draw(timelines, args.output)):
        print(f"{t.get('title', '?')}: bubble fraction {bubble:.3f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
