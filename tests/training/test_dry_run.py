"""tools/dry_run.py: the published layouts' ranks built and stepped on a fake world with meta
tensors, against the planner and the published model sizes (bench/bench_dry_run.py runs more
ranks; the table is in docs/planner.md)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megazoo.tools import dry_run as D
from megazoo.training.planning.reference_runs import published_layouts

LAYOUTS = {x.name: x for x in published_layouts()}


def _run(name: str, *extra: str):
    layout = LAYOUTS[name]
    _, run = D.parse(["--world-size", str(layout.world_size), *layout.flags, *extra])
    return layout, run


def _check_rank(report: D.RankReport) -> None:
    mem = report.memory
    # model states: the bytes the ZeRO buffers hold are the planner's, to the byte
    assert mem["model_states"] == sum(report.predicted_states)
    assert (mem["params"], mem["grads"]) == report.predicted_states[:2]
    assert report.activation_units == report.activation_bound
    assert report.activation_bytes == pytest.approx(report.predicted_activations, rel=0.05)
    assert not report.inconsistent
    assert report.checkpoint["bytes"] > mem["params"] + mem["master_params"]


def test_published_sizes():
    for layout in published_layouts():
        _, run = D.parse(["--world-size", str(layout.world_size), *layout.flags])
        assert run.model.num_parameters() == pytest.approx(layout.params, rel=0.005), layout.name


def test_bloom_176b_every_stage_and_the_last_rank_stepped():
    layout, run = _run("BLOOM-176B")
    grid = run.parallel.grid(layout.world_size)
    provider = D.model_provider(run, None)
    last = D.dry_run_rank(run, layout.world_size, layout.world_size - 1, provider)
    _check_rank(last)
    assert [c[1:3] for c in last.chunks] == [(65, 70)]  # --decoder-last-pipeline-num-layers 5
    distinct = {}
    for rank in D.chosen_ranks("stages", grid):
        distinct.update(D.dry_run_rank(run, layout.world_size, rank, provider, step=False).distinct)
    assert sum(distinct.values()) == run.model.num_parameters() == 176_247_271_424


def test_llama3_405b_last_rank_at_8192_ranks():
    layout, run = _run("Llama-3-405B")
    report = D.dry_run_rank(run, layout.world_size, layout.world_size - 1,
                            D.model_provider(run, None))
    _check_rank(report)
    assert [c[1:3] for c in report.chunks] == [(119, 126)]
    assert len(report.groups["dp"]) == 64 and len(report.groups["mp"]) == 128


def test_mtnlg_and_megatron_1t_build_at_full_world():
    for name in ("MT-NLG 530B", "Megatron-LM 1T"):
        layout, run = _run(name)
        report = D.dry_run_rank(run, layout.world_size, 0, D.model_provider(run, None),
                                step=False)
        assert report.memory["model_states"] == sum(report.predicted_states)
        assert not report.inconsistent


def test_interleaved_llama3_70b_last_rank():
    layout, run = _run("Llama-3-70B")
    report = D.dry_run_rank(run, layout.world_size, layout.world_size - 1,
                            D.model_provider(run, None))
    assert len(report.chunks) == 5 and report.chunks[-1][4]  # five chunks, the head in the last
    _check_rank(report)


def test_safetensors_size_is_the_files(tmp_path):
    from safetensors.torch import save_file
    tensors = {"b.weight": torch.zeros(3, 5, dtype=torch.bfloat16), "a": torch.zeros(7),
               "ids": torch.zeros(2, dtype=torch.int64), "u": torch.zeros(3, dtype=torch.uint8)}
    save_file(tensors, tmp_path / "x.safetensors")
    assert D.safetensors_bytes(tensors) == os.path.getsize(tmp_path / "x.safetensors")


def test_command_line_prints_and_refuses(capsys):
    reports = D.main(["--model", "gpt2", "--num-layers", "4", "--world-size", "8",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--zero-stage", "1", "--bf16", "--seq-length", "128",
                      "--micro-batch-size", "2", "--global-batch-size", "16", "--ranks", "stages"])
    out = capsys.readouterr().out
    assert "distinct parameters over every pipeline stage: 67,736,832 (the model: 67,736,832" in out
    for r in reports:
        _check_rank(r)
    for argv, message in ((["--ranks", "first,9"], "rank 9 is outside the world of 8"),
                          (["--tensor-model-parallel-size", "3"], "world size 8 is not divisible"),
                          (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                          (["--grpo-prompts", "p.jsonl", "--reward", "m:f"],
                           "--grpo-prompts: the dry run rehearses a training step on mock data")):
        with pytest.raises(SystemExit) as done:
            D.main(["--model", "gpt2", "--world-size", "8", *argv])
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.startswith("error: ") and message in err, err
        assert err.count("\n") == 1


def test_gpu_check_refuses_without_cuda():
    import subprocess
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: bench/gpu_check.sh runs for real there")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # PYTHON: this interpreter, so the suite passes from a virtual environment not activated
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(["bash", os.path.join(root, "bench", "gpu_check.sh"), "--skip-step"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=path, PYTHON=sys.executable))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().endswith("python -m pytest -q tests")
    assert "no CUDA device here" in done.stderr and "Traceback" not in done.stderr


def test_moe_rank_states_are_the_planners():
    """MoE layouts (tp2 x pp2 x dp4, ep2, every other layer MoE; pp1 under ZeRO-3; cp2 x dp4,
    ep4; and tp2 x pp2 x dp4 under Muon): on each stage the ZeRO buffers hold the planner's model states to the byte, routed
    experts sharded over the dp x cp / ep = 2 expert-data-parallel ranks, the rest over dp x cp.
    Built, not stepped (tests/training/test_dry_run_moe.py steps MoE layouts)."""
    from megazoo.training.planning import planner
    base = ["--model", "moe-tiny", "--moe-layer-freq", "2", "--bf16", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "16"]
    cases = [(8 * (1 if zero == 3 else 2), ["--tensor-model-parallel-size", "2",
                                            "--pipeline-model-parallel-size", "1" if zero == 3 else "2",
                                            "--expert-model-parallel-size", "2",
                                            "--zero-stage", str(zero)]) for zero in (0, 1, 2, 3)]
    cases.append((16, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--expert-model-parallel-size", "4", "--zero-stage", "2"]))
    # Muon: one momentum for the hidden matrices and the experts' stacked ones, AdamW's two
    # moments for the embeddings, the head and the 1-D parameters (parallel/zero/muon.py's rule)
    cases.append((16, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--expert-model-parallel-size", "2", "--zero-stage", "1",
                       "--optimizer", "muon"]))
    for world, extra in cases:
        _, run = D.parse(["--world-size", str(world), *base, *extra])
        grid = run.parallel.grid(world)
        provider = D.model_provider(run, None)
        distinct = {}
        for rank in D.chosen_ranks("stages", grid):
            report = D.dry_run_rank(run, world, rank, provider, step=False)
            distinct.update(report.distinct)
            mem = report.memory
            assert mem["model_states"] == sum(report.predicted_states), (extra, rank)
            assert (mem["params"], mem["grads"]) == report.predicted_states[:2]
            layout = planner.Layout.of_run(run, grid.dp)
            assert layout.edp == 2
            dense, expert = planner.rank_params(run.model, layout, grid.coords(rank).pp)
            assert report.numel == dense + expert and expert > 0
        assert sum(distinct.values()) == run.model.num_parameters(), extra
