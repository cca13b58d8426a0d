"""The run report: constant quantities get no panel (and are named), no title overlaps another
panel, the first row carries a second x axis in tokens, and the memory panel starts at zero."""
from megazoo.training.config.run_config import LoggingConfig
from megazoo.training.monitor.console import Progress, RunLogger
from megazoo.training.monitor.journal import RunJournal
from megazoo.training.monitor.report import choose_panels, draw_report, run_segments, token_axis


def _moe_run(folder, loss_scale=lambda it: 1.0, dropped=lambda it: 0.0, mem=lambda it: 0.5):
    """A logged MoE run of 6 log lines (batch 16 of 128 tokens)."""
    journal = RunJournal(str(folder))
    log = RunLogger(LoggingConfig(), {}, True, journal, 0, Progress(60, 0, 128))
    for it in range(10, 70, 10):
        log.log(dict(loss=5 - it / 20, lr=1e-4 * it, grad_norm=1 + it / 100, loss_scale=loss_scale(it),
                     consumed_samples=16 * it, tokens_per_s=1e3 + it, mem_gib=mem(it),
                     moe_aux_loss=0.01 + it / 1e4, moe_max_load=1.2 + it / 1e3), it)
        log.log({f"layer{i}_dropped": dropped(it) for i in range(2)} |
                {f"layer{i}_tokens_per_expert": [0.2, 0.3, 0.5 - it / 1000, 0.0 + it / 1000]
                 for i in range(2)}, it, "moe")
    return journal


def _rows(folder):
    from megazoo.training.monitor.journal import read_jsonl
    runs = run_segments(read_jsonl(str(folder / "metrics.jsonl")))
    return runs, [r for rows in runs for r in rows if r["split"] == "moe"]


def test_constant_quantities_are_named_not_drawn(tmp_path):
    _moe_run(tmp_path / "fp32")
    panels, dropped_panel, constant = choose_panels(*_rows(tmp_path / "fp32"))
    keys = [k for k, _ in panels]
    assert keys == ["loss", "lr", "grad_norm", "tokens_per_s", "moe_aux_loss", "moe_max_load"]
    assert not dropped_panel
    assert constant == ["loss scale 1", "peak memory per rank (GiB) 0.5",
                        "MoE dropped share 0 in every layer"]
    _moe_run(tmp_path / "fp16", loss_scale=lambda it: 2.0 ** (16 - it // 20),
             dropped=lambda it: it / 1000)
    panels, dropped_panel, constant = choose_panels(*_rows(tmp_path / "fp16"))
    assert "loss_scale" in [k for k, _ in panels] and dropped_panel
    assert constant == ["peak memory per rank (GiB) 0.5"]


def test_no_title_overlaps_another_panel_and_tokens_are_a_second_axis(tmp_path):
    # every panel (loss scale and dropped share vary), the heatmap and its colour bar
    _moe_run(tmp_path, loss_scale=lambda it: 2.0 ** (16 - it // 20), dropped=lambda it: it / 1000)
    fig = draw_report(str(tmp_path))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]
    titles = [(ax, ax.title) for ax in shown if ax.get_title()] + [(None, fig._suptitle)]
    assert len(titles) == 10  # 7 time panels, dropped share, heatmap, figure title
    for owner, title in titles:
        box = title.get_window_extent(renderer)
        for ax in shown:
            if ax is owner or getattr(ax, "_parent", None) is owner:
                continue
            assert not box.overlaps(ax.get_window_extent(renderer)), (title.get_text(), ax.get_title())
    for a, b in [(x, y) for i, x in enumerate(titles) for y in titles[i + 1:]]:
        assert not a[1].get_window_extent(renderer).overlaps(b[1].get_window_extent(renderer))
    secondary = [c for ax in fig.axes for c in ax.child_axes]
    assert len(secondary) == 2 and {c.get_xlabel() for c in secondary} == {"tokens"}
    label, forward, inverse = token_axis(_rows(tmp_path)[0])
    assert label == "tokens" and forward(30) == 30 * 16 * 128 and inverse(30 * 16 * 128) == 30
    assert forward(70) == 70 * 16 * 128  # past the last log line: at the last rate
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_memory_panel_starts_at_zero(tmp_path):
    """A 3% rise in peak memory is drawn as one, not as a cliff from the bottom of the panel."""
    _moe_run(tmp_path, mem=lambda it: 10.0 + it / 200)  # 10.05 .. 10.3 GiB
    fig = draw_report(str(tmp_path))
    memory = [ax for ax in fig.axes if ax.get_title() == "peak memory per rank (GiB)"]
    assert len(memory) == 1
    low, high = memory[0].get_ylim()
    assert low == 0 and high >= 10.3, (low, high)
    import matplotlib.pyplot as plt
    plt.close(fig)
