"""--async-save (training/checkpoint/async_writer.py): the step loop goes on while the rank files
are written; the files hold the state at the save; `latest` moves only once every rank's file
is written; a failed or killed background write leaves the previous checkpoint, and a run
resumes from it exactly; an async run writes the same checkpoints as a synchronous one."""
import errno
import json
import multiprocessing
import os
import signal
import threading

import pytest
import torch

import megazoo.training.checkpoint.format as ckpt
from tests.distributed import run_distributed
from megazoo.training.checkpoint import async_writer
from megazoo.training.checkpoint.async_writer import AsyncCheckpointWriter

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "0", "--seed", "5",
        "--train-iters", "4", "--save-interval", "2"]


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"model.0.weight": torch.arange(128.0).reshape(16, 8) * scale,
            "optim.bucket0.exp_avg": torch.linspace(0, 1, 64) * scale,
            "optim.iteration": torch.tensor(7), "rng.cpu": torch.arange(10, dtype=torch.uint8),
            "model.0.bf16": (torch.arange(5.0) * scale).bfloat16()}


def _pointer(root) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read().strip()


class Gate:
    """Holds rank-file writes until opened (a slow disk under the test's control)."""

    def __init__(self, monkeypatch):
        self.open, self.entered, real = threading.Event(), threading.Event(), ckpt.save_file

        def held(tensors, path, **kw):
            self.entered.set()
            self.open.wait()
            return real(tensors, path, **kw)
        monkeypatch.setattr(ckpt, "save_file", held)


def test_training_goes_on_while_the_files_are_written_and_they_hold_the_saved_state(
        tmp_path, monkeypatch):
    root, gate, live = str(tmp_path), Gate(monkeypatch), _tensors()
    writer = AsyncCheckpointWriter(rank=0, world_size=1)
    assert writer.start(root, 2, live, {"model": {}}) == ckpt.iteration_dir(root, 2)
    assert gate.entered.wait(60) and writer.in_flight == 2
    assert writer.poll() is None  # still writing: nothing committed, training goes on
    assert not os.path.exists(os.path.join(root, "latest"))
    for t in live.values():  # the next optimizer steps change the tensors in place
        t.add_(1)
    gate.open.set()
    assert writer.wait() == ckpt.iteration_dir(root, 2) and writer.in_flight is None
    assert _pointer(root) == "iter_0000002" and ckpt.verify_folder(ckpt.iteration_dir(root, 2)) == []
    saved = ckpt.load_rank_tensors(ckpt.iteration_dir(root, 2), 0)
    assert all(torch.equal(saved[k], v) for k, v in _tensors().items())  # the state at the save

    # At most one save in flight: the next save first commits the previous one.
    gate.open.clear()
    gate.entered.clear()
    writer.start(root, 4, _tensors(2.0), {"model": {}})
    assert gate.entered.wait(60)
    monkeypatch.setattr(writer, "wait", _after(writer.wait, gate.open.set))
    copies = {k: v.data_ptr() for k, v in writer._buffers.items()}
    writer.start(root, 6, _tensors(3.0), {"model": {}})
    assert {k: v.data_ptr() for k, v in writer._buffers.items()} == copies  # host copy reused
    assert writer.in_flight == 6 and _pointer(root) == "iter_0000004"
    writer.wait()
    assert _pointer(root) == "iter_0000006" and [s["iteration"] for s in writer.saves] == [2, 4, 6]
    for it, scale in ((4, 2.0), (6, 3.0)):
        saved = ckpt.load_rank_tensors(ckpt.iteration_dir(root, it), 0)
        assert all(torch.equal(saved[k], v) for k, v in _tensors(scale).items())


def _after(wait, before):
    """`wait` that first runs `before` (opens the gate the writer thread is held at)."""
    def run():
        before()
        return wait()
    return run


def test_a_failed_background_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    writer = AsyncCheckpointWriter(rank=0, world_size=1)
    writer.start(root, 2, _tensors(), {"model": {}})
    writer.wait()

    def full_disk(tensors, path, **kw):
        with open(path, "wb") as f:  # a partial file, as a write cut short leaves
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    writer.start(root, 4, _tensors(2.0), {"model": {}})
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00000.safetensors: no space left on "
                                                   r"device; checkpoint 4 not saved, the previous "
                                                   r"one is kept \(latest = iter_0000002\)$"):
        writer.wait()
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest"]
    assert writer.in_flight is None and writer.wait() is None

    def no_memory(tensors, buffers):
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    monkeypatch.setattr(async_writer, "host_copy", no_memory)
    with pytest.raises(ckpt.CheckpointError, match=r"^rank 0: no host memory for --async-save's copy "
                                                   r"of its tensors \(CUDA error: out of memory\); .*"
                                                   r"checkpoint 6 not saved, the previous one is kept "
                                                   r"\(latest = iter_0000002\)$"):
        writer.start(root, 6, _tensors(), {"model": {}})
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest"] and writer.in_flight is None


def _pretrain(argv, world: int = 1):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    return pretrain(model_provider, to_run_config(build_parser().parse_args(TINY + argv),
                                                  world_size=world))


def _files(folder) -> dict[str, torch.Tensor]:
    return ckpt.load_rank_tensors(folder, 0)


def _assert_same_files(a, b):
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa), (a, b)


def _killed_mid_write(root, writing):
    """A run (forked: nothing to import again) whose writer hangs half-way through the
    iteration-4 file, to be killed there."""
    real = ckpt.save_file

    def hangs_mid_write(tensors, path, **kw):
        if "iter_0000004" not in path:
            return real(tensors, path, **kw)
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        writing.set()
        threading.Event().wait()

    ckpt.save_file = hangs_mid_write
    _pretrain(["--save", root, "--async-save"])


def test_async_run_equals_sync_and_resumes_exactly_after_a_writer_crash(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    sync, fast = str(tmp_path / "sync"), str(tmp_path / "async")
    want = _pretrain(["--save", sync])
    got = _pretrain(["--save", fast, "--async-save"])
    assert got.losses == want.losses and got.checkpoint == ckpt.iteration_dir(fast, 4)
    for it in (2, 4):
        _assert_same_files(ckpt.iteration_dir(fast, it), ckpt.iteration_dir(sync, it))
    assert _pointer(fast) == "iter_0000004"

    # A rollback at iteration 3 goes back to the iteration-2 save, whose write may still be in
    # flight (no commit check has run since): it is waited for and committed first.
    rolled = str(tmp_path / "rolled")
    again = _pretrain(["--save", rolled, "--async-save", "--health-policy", "rollback",
                       "--inject-nan-at-iteration", "3"])
    events = [json.loads(line) for line in open(os.path.join(rolled, "journal.jsonl"))]
    assert [(e["iteration"], e["to_iteration"]) for e in events if e["kind"] == "rollback"] == [(3, 2)]
    assert again.losses == want.losses

    # The writer raises during the iteration-4 save: the run ends with the one-line error and
    # the iteration-2 checkpoint stays `latest` (resuming from it: the kill below).
    raised = str(tmp_path / "raised")
    real = ckpt.write_rank_file

    def fails_at_4(tmp, rank, tensors):
        if "iter_0000004" in tmp:
            raise ckpt.CheckpointError(f"{ckpt.rank_file(tmp, rank)}: input/output error")
        return real(tmp, rank, tensors)

    monkeypatch.setattr(ckpt, "write_rank_file", fails_at_4)
    with pytest.raises(ckpt.CheckpointError, match=r"input/output error; checkpoint 4 not saved, "
                                                   r"the previous one is kept \(latest = iter_0000002\)"):
        _pretrain(["--save", raised, "--async-save"])
    monkeypatch.undo()
    assert _pointer(raised) == "iter_0000002" and [n for n in os.listdir(raised) if "iter" in n] == [
        "iter_0000002"]

    # kill -9 while the background writer is half-way through the iteration-4 file.
    killed, fork = str(tmp_path / "killed"), multiprocessing.get_context("fork")
    writing = fork.Event()
    proc = fork.Process(target=_killed_mid_write, args=(killed, writing), daemon=True)
    proc.start()
    try:
        assert writing.wait(120)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert os.path.isdir(ckpt.iteration_dir(killed, 4) + ".tmp") and _pointer(killed) == "iter_0000002"
    assert ckpt.latest_checkpoint(killed) == ckpt.iteration_dir(killed, 2)
    resumed = _pretrain(["--save", killed, "--load", killed, "--async-save"])
    assert resumed.losses == want.losses[2:]
    _assert_same_files(ckpt.iteration_dir(killed, 4), ckpt.iteration_dir(sync, 4))


def _two_rank_worker(rank, root):
    """A slow rank holds the commit back; a rank whose write fails stops both with one line;
    a dp2 run with --async-save writes what the synchronous save writes."""
    import megazoo.training.checkpoint.format as fmt
    from megazoo.training.checkpoint.async_writer import AsyncCheckpointWriter as Writer
    done, writer = [], Writer(rank, 2)
    gate, real = threading.Event(), fmt.save_file

    def slow_on_rank_1(tensors, path, **kw):
        if rank == 1:
            gate.wait()
        if "iter_0000004" in path and rank == 1:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(tensors, path, **kw)

    fmt.save_file = slow_on_rank_1
    writer.start(root, 2, {"w": torch.full((4,), float(rank))}, {"model": {}})
    done.append(writer.poll() is None)  # rank 1 is still writing: no rank commits
    done.append(not os.path.exists(os.path.join(root, "latest")))
    gate.set()
    done.append(writer.wait() == fmt.iteration_dir(root, 2))
    done.append(_pointer(root) == "iter_0000002")
    done.append(fmt.load_rank_tensors(fmt.iteration_dir(root, 2), 1)["w"].tolist() == [1.0] * 4)
    writer.start(root, 4, {"w": torch.zeros(4)}, {"model": {}})
    try:
        writer.wait()
    except fmt.CheckpointError as e:
        message = str(e)
    done.append(_pointer(root) == "iter_0000002")
    fmt.save_file = real
    torch.manual_seed(0)
    want = _pretrain(["--save", os.path.join(root, "sync")], world=2)
    got = _pretrain(["--save", os.path.join(root, "async"), "--async-save"], world=2)
    done.append(got.losses == want.losses and len(got.losses) == 4)
    for it in (2, 4):
        a = fmt.load_rank_tensors(fmt.iteration_dir(os.path.join(root, "async"), it), rank)
        b = fmt.load_rank_tensors(fmt.iteration_dir(os.path.join(root, "sync"), it), rank)
        done.append(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
    return done, message


def test_two_ranks_wait_for_the_slowest_stop_on_any_failed_write_and_match_sync(tmp_path):
    results = run_distributed(_two_rank_worker, 2, str(tmp_path))
    for done, _ in results:
        assert done == [True] * 9
    assert results[0][1] == "another rank could not write its part; checkpoint 4 not saved, the " \
                            "previous one is kept (latest = iter_0000002)"
    assert results[1][1].endswith("Input/output error (" + os.path.join(
        str(tmp_path), "iter_0000004.tmp", "rank_00001.safetensors") + "); checkpoint 4 not saved, "
        "the previous one is kept (latest = iter_0000002)")


def test_async_save_without_save_is_refused_in_one_line():
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    argv = TINY[:-2] + ["--async-save"]  # without --save-interval 2
    with pytest.raises(ArgumentError, match=r"^--async-save writes the checkpoints of --save in the "
                                            r"background; give --save DIR$"):
        to_run_config(build_parser().parse_args(argv), world_size=1)
