"""Checkpoint integrity and storage: per-tensor checksums verified at load, export and by
tools/inspect_checkpoint.py --verify; fallback to the newest checkpoint that verifies; `latest`
recovery; --keep-last/--keep-every; the --save lock; ENOSPC and free-space refusals."""
import errno
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import megazoo.training.checkpoint.format as ckpt
from tests.distributed import run_distributed
from tests.helpers import TINY, one_thread, pretrain_gpt  # noqa: F401 - one_thread: autouse
from tests.tool_runs import REPO, tool_output
from megazoo.training.checkpoint import storage


def flip(path: str, tensor: str, n: int = 8) -> None:
    """Invert `n` bytes in the middle of one tensor's data inside a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(size))[tensor]["data_offsets"]
    at = 8 + size + (start + end) // 2 - min(n, end - start) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(min(n, end - start))
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


TENSORS = {"model.0.weight": torch.randn(16, 8), "optim.bucket0.master": torch.randn(64),
           "optim.bucket0.exp_avg_sq": torch.rand(64), "optim.iteration": torch.tensor(7),
           "rng.cpu": torch.arange(10, dtype=torch.uint8), "model.0.bf16": torch.randn(5).bfloat16()}


@pytest.mark.parametrize("tensor", sorted(TENSORS))
def test_flipped_bytes_in_any_tensor_are_named(tmp_path, tensor):
    folder = ckpt.save_checkpoint(str(tmp_path), 3, 0, 1, TENSORS, {"model": {}})
    loaded = ckpt.load_rank_tensors(folder, 0)
    assert all(torch.equal(loaded[k], v) for k, v in TENSORS.items())
    assert ckpt.verify_folder(folder) == []
    flip(ckpt.rank_file(folder, 0), tensor, n=1)
    with pytest.raises(ckpt.IntegrityError, match=rf"rank_00000.safetensors: tensor {tensor} fails "
                                                  rf"its checksum"):
        ckpt.load_rank_tensors(folder, 0)
    problems = ckpt.verify_folder(folder)
    assert len(problems) == 1 and tensor in problems[0] and "\n" not in problems[0]


def test_latest_recovery_and_a_crash_inside_a_resave(tmp_path, monkeypatch):
    root = str(tmp_path)
    for it in (2, 4):
        ckpt.save_checkpoint(root, it, 0, 1, TENSORS, {"model": {}})
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("iter_0000006")  # names a folder that is gone
    assert ckpt.latest_checkpoint(root).endswith("iter_0000004")
    assert [os.path.basename(f) for f in ckpt.candidates(root)] == ["iter_0000004", "iter_0000002"]
    ckpt.save_checkpoint(root, 4, 0, 1, TENSORS, {"model": {}})  # repairs the pointer
    # Crash while re-saving iteration 4, at the moment the new folder would be renamed into place:
    real = os.replace

    def dying_replace(src, dst):
        if src.endswith("iter_0000004.tmp"):
            raise KeyboardInterrupt("killed")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 4, 0, 1, {k: v + 1 for k, v in TENSORS.items()}, {"model": {}})
    monkeypatch.undo()
    named = open(os.path.join(root, "latest")).read().strip()
    assert os.path.isfile(os.path.join(root, named, "meta.json")), named  # never dangling
    assert torch.equal(ckpt.load_rank_tensors(ckpt.latest_checkpoint(root), 0)["model.0.weight"],
                       TENSORS["model.0.weight"])
    ckpt.save_checkpoint(root, 4, 0, 1, TENSORS, {"model": {}})  # the next save cleans up
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "latest"]


def test_enospc_and_low_space_keep_the_previous_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 2, 0, 1, TENSORS, {"model": {}})

    def full_disk(tensors, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00000.safetensors: no space left on "
                                                   r"device; checkpoint 4 not saved, the previous "
                                                   r"one is kept \(latest = iter_0000002\)"):
        ckpt.save_checkpoint(root, 4, 0, 1, TENSORS, {"model": {}})
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest"]
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: os.statvfs_result((0,) * 10)
                        if False else type("U", (), {"free": 1000})())
    with pytest.raises(ckpt.CheckpointError, match=r"--save .*: 0.00 GiB free, a checkpoint needs "
                                                   r"about .* GiB; free space there, .* --keep-last N "
                                                   r"\(a save that lacks room then first deletes .*\); "
                                                   r"checkpoint 4 not saved"):
        ckpt.save_checkpoint(root, 4, 0, 1, TENSORS, {"model": {}})
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest"]


def test_save_lock_names_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from training.checkpoint.storage import SaveLock; l = SaveLock(sys.argv[2]);"
                               "print('held', flush=True); time.sleep(60)", REPO, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(storage.SaveLockError, match=rf"--save {tmp_path} is in use by another "
                                                        rf"job \(host \S+ pid {holder.pid} since"):
            pretrain_gpt(TINY + ["--train-iters", "1", "--save", str(tmp_path)], 1)
    finally:
        holder.kill()
        holder.wait()
    lock = storage.SaveLock(str(tmp_path))  # the kernel dropped the dead holder's lock
    lock.release()


def test_keep_last_and_keep_every(tmp_path):
    root = str(tmp_path)
    pretrain_gpt(TINY + ["--train-iters", "10", "--save", root, "--save-interval", "1",
                         "--keep-last", "2", "--keep-every", "4"], 1)
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == \
        ["iter_0000004", "iter_0000008", "iter_0000009", "iter_0000010"]
    pretrain_gpt(TINY + ["--train-iters", "12", "--save", root, "--load", root, "--save-interval", "1",
                         "--keep-last", "2"], 1)
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == \
        ["iter_0000011", "iter_0000012"]


def _fallback_worker(rank, root, hf):
    pretrain_gpt(TINY + ["--train-iters", "4", "--save", root, "--save-interval", "2"], 2)
    import torch.distributed as dist
    path = os.path.join(root, "iter_0000004", "rank_00001.safetensors")
    master = next(k for k in ckpt.VerifiedReader(path).keys() if k.endswith(".master"))
    if rank == 0:  # damage rank 1's fp32 masters of the newest checkpoint
        flip(path, master, n=64)
    dist.barrier()
    resumed = pretrain_gpt(TINY + ["--train-iters", "6", "--save", root, "--load", root,
                                   "--save-interval", "100"], 2)
    return len(resumed.losses), master


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    root, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    steps, master = run_distributed(_fallback_worker, 2, root, hf, timeout=300)[0]
    assert steps == 4  # resumed from iteration 2, not 4
    rc, out, _ = tool_output("inspect_checkpoint", os.path.join(root, "iter_0000004"), "--verify")
    assert rc == 1
    assert f"PROBLEM {root}/iter_0000004/rank_00001.safetensors: tensor {master} fails its " \
           f"checksum" in out
    # the script itself (its entry point), as a user runs it
    ok = subprocess.run([sys.executable, os.path.join(REPO, "tools", "inspect_checkpoint.py"), root,
                         "--verify"], capture_output=True, text=True)
    assert ok.returncode == 0 and "every tensor matches its checksum" in ok.stdout, ok.stdout
    from megazoo.training.checkpoint.hf import export_hf
    with pytest.raises(ckpt.IntegrityError, match=rf"rank_00001.safetensors: tensor {master} fails"):
        export_hf(os.path.join(root, "iter_0000004"), hf)
    export_hf(root, hf)
    assert os.path.isfile(os.path.join(hf, "model.safetensors"))
