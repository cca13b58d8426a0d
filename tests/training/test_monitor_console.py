"""The console says where a run is: iteration/total, elapsed, ETA and tokens on every train line
(and in metrics.jsonl, added beside the existing fields), and a closing summary paragraph."""
import json
import logging

from megazoo.training.config.run_config import LoggingConfig
from megazoo.training.monitor.console import Progress, RunLogger
from megazoo.training.monitor.journal import RunJournal


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _logger(tmp_path, clock, start=0):
    progress = Progress(total_iterations=200, start_iteration=start, seq_length=128, clock=clock)
    return RunLogger(LoggingConfig(), {}, True, RunJournal(str(tmp_path)), start, progress)


def test_each_line_has_iteration_of_total_elapsed_eta_and_tokens(tmp_path, caplog):
    clock = Clock()
    log = _logger(tmp_path, clock, start=50)  # resumed at 50: the ETA uses this run's pace
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        clock.now += 75.0
        log.log(dict(loss=2.5, lr=1e-3, consumed_samples=1200), 100)  # 50 iterations in 75 s
        log.log(dict(loss=2.7), 100, "valid")
        clock.now += 3600.0
        log.log(dict(loss=2.0, lr=1e-3, consumed_samples=4800), 200)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("train iter 100/200 | elapsed 0:01:15 | ETA 0:02:30 | tokens 154k | "
                               "loss 2.500000 | lr 1.000e-03 | consumed_samples 1200"), lines[0]
    assert lines[1] == "valid iter 100/200 | loss 2.700000"
    assert lines[2].startswith("train iter 200/200 | elapsed 1:01:15 | ETA 0:00:00 | tokens 614k |")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1:]
    assert rows[0] == dict(iteration=100, split="train", train_iters=200, elapsed_s=75.0, eta_s=150.0,
                           tokens=153600, loss=2.5, lr=1e-3, consumed_samples=1200)
    assert rows[1] == dict(iteration=100, split="valid", loss=2.7)


def test_the_first_line_of_a_run_has_no_eta_yet_and_a_logger_without_progress_is_unchanged(
        tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        _logger(tmp_path, Clock(), start=7).log(dict(loss=1.0, consumed_samples=8), 7)
        RunLogger(LoggingConfig(), {}, True, RunJournal(None)).log(dict(loss=1.0), 3)
    first, plain = [r.getMessage() for r in caplog.records]
    assert first.startswith("train iter 7/200 | elapsed 0:00:00 | ETA - | tokens 1.02k |")
    assert plain == "train iter 3 | loss 1.000000"


def test_the_run_ends_with_a_summary(tmp_path, caplog):
    clock = Clock()
    log = _logger(tmp_path, clock)
    for it, loss, valid in ((100, 3.0, 3.2), (150, 2.4, 2.9), (200, 2.6, 3.0)):
        clock.now += 60
        log.log(dict(loss=loss, consumed_samples=it * 16), it)
        log.log(dict(loss=valid), it, "valid")
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        text = log.summary(200, 3200, ["/ck/iter_0000100", "/ck/iter_0000200"], "/ck")
    assert caplog.records[-1].getMessage() == text
    assert text == ("run finished: iteration 200 of 200 (200 in this run); 410k tokens seen; "
                    "0:03:00 of training in this run; training loss 2.6000 at the end, best 2.4000 "
                    "(iteration 150); validation loss 3.0000 at the end, best 2.9000 (iteration "
                    "150); 2 checkpoints written to /ck (the last: iter_0000200).")
    event = [json.loads(line) for line in open(tmp_path / "journal.jsonl")][-1]
    assert event["kind"] == "summary" and event["tokens"] == 409600 and event["text"] == text
    stopped = _logger(tmp_path, clock, start=40).summary(60, 960, [], None)
    assert stopped.startswith("run stopped early: iteration 60 of 200 (20 in this run); 123k tokens")
    assert stopped.endswith("; no checkpoint written (no --save).")
