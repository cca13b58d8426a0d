"""The timeline tool draws a schedule and reports its bubble (simulated events, no processes)."""
from __future__ import annotations

import json

import pytest

from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.pipeline.simulate import simulate
from megazoo.tools.draw_timeline import bubble_fraction, main


def _timeline(name, pp, vpp, m):
    sim = simulate([build_schedule(name, pp, r, m, vpp) for r in range(pp)], vpp,
                   forward_time=1 / vpp, backward_time=2 / vpp)
    ranks = [{"rank": r, "events": [list(e) for e in evs]} for r, evs in enumerate(sim.events)]
    return sim, {"title": f"{name} p={pp} v={vpp} m={m}", "ranks": ranks}


def test_bubble_fraction_matches_theory_and_png_is_written(tmp_path, capsys):
    paths = []
    for name, vpp in (("1f1b", 1), ("interleaved", 2)):
        sim, timeline = _timeline(name, 4, vpp, 8)
        # Bubble of a pipeline with p stages and m microbatches: (p-1)/v / (m + (p-1)/v).
        assert bubble_fraction(timeline["ranks"]) == pytest.approx(3 / vpp / (8 + 3 / vpp))
        assert bubble_fraction(timeline["ranks"]) == pytest.approx(sim.bubble_fraction())
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(timeline))
    png = tmp_path / "timeline.png"
    assert main([str(p) for p in paths] + ["-o", str(png)]) == 0
    assert png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "1f1b p=4 v=1 m=8: bubble fraction 0.273" in out
