"""Dry runs of the published layouts (tools/dry_run.py) against the planner and the published
sizes, and how group construction and a one-rank dry run scale with the world size.

    python bench/bench_dry_run.py            # the table in docs/planner.md, bench/results/dry_run.json
    python bench/bench_dry_run.py --table    # the tables again, from the JSON
    python bench/bench_dry_run.py --only DeepSeek-V3   # one layout's rows redone in the JSON

Per layout: the first, a middle and the last rank with one training step's schedule, and one rank
per pipeline stage (built, not stepped) for the distinct parameter count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazoo.tools import dry_run as D  # noqa: E402
from megazoo.training.planning.reference_runs import published_layouts  # noqa: E402

GiB = 2 ** 30
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dry_run.json")


def run_layout(layout) -> dict:
    _, run = D.parse(["--world-size", str(layout.world_size), *layout.flags])
    grid = run.parallel.grid(layout.world_size)
    provider = D.model_provider(run, None)
    middle = grid.rank(grid.pp // 2, grid.dp // 2, 0, grid.tp - 1)
    rows = []
    for rank in dict.fromkeys([0, middle, layout.world_size - 1]):
        t = time.perf_counter()
        r = D.dry_run_rank(run, layout.world_size, rank, provider)
        wall = time.perf_counter() - t
        print(D.rank_text(r), flush=True)
        rows.append(dict(rank=r.rank, coords=r.coords, chunks=r.chunks, numel=r.numel,
                         model_states=r.memory["model_states"],
                         predicted_states=sum(r.predicted_states),
                         activations=r.activation_bytes, predicted_activations=r.predicted_activations,
                         units=r.activation_units, bound=r.activation_bound,
                         checkpoint_bytes=r.checkpoint["bytes"], buckets=len(r.buckets),
                         consistent=not r.inconsistent, seconds=r.seconds, wall=wall))
    distinct = {}
    t = time.perf_counter()
    for rank in D.chosen_ranks("stages", grid):
        distinct.update(D.dry_run_rank(run, layout.world_size, rank, provider, step=False).distinct)
    return dict(name=layout.name, world=layout.world_size, source=layout.source,
                layout=f"tp{grid.tp} pp{grid.pp} dp{grid.dp}" + (f" vpp{run.parallel.vpp}"
                                                               if run.parallel.vpp > 1 else ""),
                published=layout.params, distinct=sum(distinct.values()),
                model=run.model.num_parameters(), stages_seconds=time.perf_counter() - t, ranks=rows)


def scaling() -> list[dict]:
    """Group construction and a one-rank dry run (last rank, Llama-3-405B shape) per world."""
    base = next(x for x in published_layouts() if x.name == "Llama-3-405B")
    out = []
    for world in (512, 1024, 2048, 4096, 8192, 16384):
        flags = [f for f in base.flags]
        flags[flags.index("--global-batch-size") + 1] = str(world // 128 * 32)
        _, run = D.parse(["--world-size", str(world), *flags])
        groups = {tuple(g) for gs in run.parallel.grid(world).groups().values() for g in gs
                  if len(g) > 1}
        best = None
        for _ in range(3):  # the machine is shared: the fastest of three
            t = time.perf_counter()
            r = D.dry_run_rank(run, world, world - 1, D.model_provider(run, None))
            row = dict(world=world, process_groups=len(groups), groups=r.seconds["groups"],
                       build=r.seconds["build"], step=r.seconds["step"],
                       total=time.perf_counter() - t)
            best = row if best is None or row["total"] < best["total"] else best
        out.append(best)
        print(out[-1], flush=True)
    return out


def table(results: list[dict]) -> str:
    lines = ["| run | ranks | layout | rank (pp) | layers | params held | model states GiB: dry run / "
             "planner | activations GiB: dry run / planner | error | checkpoint GiB | groups "
             "consistent |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["ranks"]:
            layers = sum(b - a for _, a, b, _, _ in r["chunks"])
            err = r["predicted_activations"] / r["activations"] - 1
            lines.append(
                f"| {res['name']} | {res['world']} | {res['layout']} | {r['rank']} ({r['coords'][0]})"
                f" | {layers} | {r['numel'] / 1e9:.3f}B | {r['model_states'] / GiB:.3f} / "
                f"{r['predicted_states'] / GiB:.3f} | {r['activations'] / GiB:.3f} / "
                f"{r['predicted_activations'] / GiB:.3f} | {err:+.2%} | "
                f"{r['checkpoint_bytes'] / GiB:.2f} | {'yes' if r['consistent'] else 'NO'} |")
    lines += ["", "| run | distinct parameters (dry run, every stage) | TransformerConfig | published "
              "| vs published |", "|---|---|---|---|---|"]
    for res in results:
        lines.append(f"| {res['name']} | {res['distinct']:,} | {res['model']:,} | "
                     f"{res['published']:,.0f} | {res['distinct'] / res['published'] - 1:+.3%} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", action="store_true", help="print the tables from the JSON only")
    p.add_argument("--only", metavar="NAME", help="dry-run this published layout alone and "
                                                   "replace (or add) its rows in the JSON")
    args = p.parse_args(argv)
    if args.only:
        layouts = {x.name: x for x in published_layouts()}
        if args.only not in layouts:
            p.error(f"--only: {args.only!r} is not a published layout; choose one of "
                    f"{sorted(layouts)}")
        with open(OUT) as f:
            saved = json.load(f)
        row = run_layout(layouts[args.only])
        saved["layouts"] = [r for r in saved["layouts"] if r["name"] != args.only] + [row]
        with open(OUT, "w") as f:
            json.dump(saved, f, indent=1)
    elif not args.table:
        results = [run_layout(layout) for layout in published_layouts()]
        scale = scaling()
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "w") as f:
            json.dump(dict(layouts=results, scaling=scale), f, indent=1)
    with open(OUT) as f:
        saved = json.load(f)
    print(table(saved["layouts"]))
    print("\n| world | process groups | groups s | build s | step s | one rank, total s |\n"
          "|---|---|---|---|---|---|")
    for s in saved["scaling"]:
        print(f"| {s['world']} | {s['process_groups']:,} | {s['groups']:.2f} | {s['build']:.2f} | "
              f"{s['step']:.2f} | {s['total']:.2f} |")


if __name__ == "__main__":
    main()
