"""The run folder's files: metrics segments per run, the report drawing each run, the wandb run a
resume continues, checkpoint files readable as the umask allows, MFU only from a known peak."""
import json
import logging
import os
import sys
import types

import pytest
import torch

from megazoo.training.config.run_config import LoggingConfig
from megazoo.training.monitor.journal import RunJournal
from megazoo.training.monitor.console import WANDB_ID, RunLogger
from megazoo.training.monitor.report import run_segments, write_report


def test_each_run_is_a_segment_and_the_report_draws_them(tmp_path):
    journal = RunJournal(str(tmp_path))
    for start, its in [(0, [10, 20, 30]), (0, [10, 20]), (20, [30, 40])]:  # rerun, then resume at 20
        log = RunLogger(LoggingConfig(), {}, True, journal, start_iteration=start)
        for it in its:
            log.log(dict(loss=5.0 - it / 10, lr=1e-3, tokens_per_s=100.0, mem_gib=0.1), it)
        log.log(dict(loss=4.0), its[-1], "valid")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["resumed"] for r in rows if r["split"] == "start"] == [False, False, True]
    runs = run_segments(rows)
    assert [[r["iteration"] for r in run if r["split"] == "train"] for run in runs] == [[10, 20, 30], [10, 20], [30, 40]]
    assert run_segments([r for r in rows if r["split"] != "start"]) == [[r for r in rows if r["split"] != "start"]]
    assert os.path.getsize(write_report(str(tmp_path))) > 10_000


def test_a_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    calls = []

    class Run:
        def __init__(self, id):
            self.id = id or "new123"

        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or Run(kw["id"]))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(wandb_project="p")
    RunLogger(cfg, {}, True, RunJournal(str(tmp_path))).close()
    RunLogger(cfg, {}, True, RunJournal(str(tmp_path)), start_iteration=5).close()
    assert open(tmp_path / WANDB_ID).read() == "new123"
    assert [(c["id"], c["resume"]) for c in calls] == [(None, "allow"), ("new123", "allow")]


def test_checkpoint_files_follow_the_umask(tmp_path):
    from megazoo.training.checkpoint.format import rank_file, save_checkpoint
    folder = save_checkpoint(str(tmp_path), 1, 0, 1, {"w": torch.ones(3)}, {"model": {}})
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(rank_file(folder, 0)).st_mode & 0o777 == 0o666 & ~umask


def test_mfu_comes_from_a_documented_peak(caplog):
    from megazoo.training.monitor.metrics import PEAK_FLOPS, device_peak_flops, mfu
    assert device_peak_flops(torch.device("cpu")) == (0.0, "no MFU on CPU without --peak-flops")
    assert device_peak_flops(torch.device("cpu"), 2e12)[0] == 2e12
    table = dict(PEAK_FLOPS)
    assert (table["H200"]["bfloat16"], table["H100"]["float32"], table["A100"]["float16"]) == \
        (989e12, 67e12, 312e12)
    with caplog.at_level(logging.WARNING):
        assert mfu(5e11, 1e12) == 0.5 and not caplog.records
        assert mfu(2e12, 1e12) == 2.0
    assert "MFU 2.00 is above 1" in caplog.records[0].getMessage()


@pytest.mark.parametrize("name, dtype, peak", [("NVIDIA H100 PCIe", "bfloat16", 756e12),
                                                ("NVIDIA H100 80GB HBM3", "float32", 67e12),
                                                ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
                                                ("Tesla T4", "float16", 0.0)])
def test_gpu_peaks_by_name(monkeypatch, name, dtype, peak):
    from megazoo.training.monitor.metrics import device_peak_flops
    monkeypatch.setattr(torch, "get_device_module", lambda device: types.SimpleNamespace(
        get_device_name=lambda d: name))
    assert device_peak_flops(torch.device("cuda", 0), params_dtype=dtype)[0] == peak


def test_the_report_draws_moe_layers(tmp_path, monkeypatch):
    """An MoE run's report adds each layer's dropped share and tokens per expert (the rows
    `moe_metrics` logs under the "moe" split) to the summary panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    log = RunLogger(LoggingConfig(), {}, True, RunJournal(str(tmp_path)))
    for it in (10, 20, 30):
        log.log(dict(loss=5.0, lr=1e-3, tokens_per_s=100.0, mem_gib=0.1, moe_aux_loss=0.01,
                     moe_max_load=1.5 + it / 100), it)  # (a constant gets no panel)
        log.log({f"layer{i}_dropped": 0.1 * i for i in range(2)} |
                {f"layer{i}_load": 1.5 for i in range(2)} |
                {f"layer{i}_tokens_per_expert": [0.1, 0.2, 0.3, 0.4] for i in range(2)}, it, "moe")
    drawn = []
    real_savefig = plt.Figure.savefig

    def savefig(fig, *a, **k):
        drawn.append([ax.get_title() for ax in fig.axes])
        return real_savefig(fig, *a, **k)
    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    assert os.path.getsize(write_report(str(tmp_path))) > 10_000
    titles = drawn[0]
    assert "MoE dropped share of assignments, per layer" in titles
    assert "MoE share of assignments per expert (iteration 30)" in titles
    assert "MoE busiest expert / mean (worst layer)" in titles
