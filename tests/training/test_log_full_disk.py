"""A full disk under the run log (metrics.jsonl, journal.jsonl) ends the run with one line from
the rank that could not write, exit code 1, no traceback on any rank, and the newest checkpoint
verifying: the OSError(ENOSPC) is injected into the writer, no disk is filled.

- two ranks, rank 0's metrics.jsonl full from iteration 3 (checkpoints every 2): rank 0 says so
  in one line, rank 1 stops silently, both exit 1; `latest` is iter 2 and verifies;
- one process, journal.jsonl full when the closing summary is written (after the last save): one
  line, exit 1, the final checkpoint verifies.
"""
import contextlib
import errno
import io
import logging
import os
import sys

import pytest

from tests.distributed import run_distributed

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
        "--eval-interval", "1000", "--seed", "5", "--train-iters", "5", "--save-interval", "2"]


def _full_disk(name: str, after: int):
    """journal._append that fails with ENOSPC on `name` once it wrote `after` lines to it."""
    from megazoo.training.monitor import journal
    real, seen = journal._append, {"n": 0}

    def append(path, record):
        if os.path.basename(path) == name:
            seen["n"] += 1
            if seen["n"] > after:
                raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, record)
    return append


def _run(argv) -> tuple[int, str]:
    """train_gpt's main in this process: (exit code, what it wrote to stderr)."""
    from megazoo.training.run.entry import main
    err = io.StringIO()
    if not logging.getLogger().handlers:  # a spawned rank: its log apart from the error line
        logging.getLogger().addHandler(logging.StreamHandler(sys.__stderr__))
    with contextlib.redirect_stderr(err):
        try:
            main("gpt2", argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _two_ranks(rank: int, save: str):
    from megazoo.training.monitor import journal
    from megazoo.training.run import entry
    saved = entry.SILENT_RANK_WAIT_S, journal._append  # the rank's process serves later worlds
    entry.SILENT_RANK_WAIT_S = 0.0  # no torchrun here to end the silent rank's wait
    if rank == 0:  # the start line and iterations 1, 2 written; iteration 3's line fails
        journal._append = _full_disk("metrics.jsonl", 3)
    try:
        return _run(ARGS + ["--save", save])
    finally:
        entry.SILENT_RANK_WAIT_S, journal._append = saved


def test_full_disk_under_the_run_log_ends_in_one_line(tmp_path, monkeypatch):
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.monitor import journal
    save = str(tmp_path / "two")
    (code0, err0), (code1, err1) = run_distributed(_two_ranks, 2, save, timeout=240)
    assert (code0, code1) == (1, 1), (err0, err1)
    assert err1 == "", err1
    assert err0.count("\n") == 1 and "Traceback" not in err0, err0
    assert err0.startswith("error (rank 0): ") and "metrics.jsonl: no space left on device" in err0
    assert "resume with --load" in err0
    latest = ckpt.latest_checkpoint(save)
    assert os.path.basename(latest) == "iter_0000002" and ckpt.verify_folder(latest) == []
    logged = [r["iteration"] for r in journal.read_jsonl(os.path.join(save, "metrics.jsonl"))
              if r["split"] == "train"]
    assert logged == [1, 2]

    one = str(tmp_path / "one")
    monkeypatch.setattr(journal, "_append", _full_disk("journal.jsonl", 0))
    monkeypatch.setattr("megazoo.training.run.trainer.write_report", lambda run_dir: "(not drawn)")
    code, err = _run(ARGS + ["--save", one])
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and "journal.jsonl: no space left on device" in err, err
    latest = ckpt.latest_checkpoint(one)
    assert os.path.basename(latest) == "iter_0000005" and ckpt.verify_folder(latest) == []
    assert not os.path.exists(os.path.join(one, "journal.jsonl"))


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EACCES])
def test_the_journal_records_the_first_failed_write_and_stops_writing(tmp_path, monkeypatch, errno_):
    from megazoo.training.monitor import journal
    j = journal.RunJournal(str(tmp_path))
    j.metrics(1, "train", {"loss": 1.0})
    calls = []

    def failing(path, record):
        calls.append(path)
        raise OSError(errno_, os.strerror(errno_), path)
    monkeypatch.setattr(journal, "_append", failing)
    j.event("spike", iteration=2)
    j.metrics(2, "train", {"loss": 1.0})
    assert len(calls) == 1 and j.failed.startswith(os.path.join(str(tmp_path), "journal.jsonl"))
    assert ("no space left on device" in j.failed) == (errno_ == errno.ENOSPC)
