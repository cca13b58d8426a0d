"""Checkpoint edges as one line, and a --save folder that only its lock holder writes.

- 64 random bytes in `latest`: resume falls back to the newest complete folder (warning that
  counts, not prints, the bytes); with no folder left, one line; tools/inspect_checkpoint.py says
  the same in one line.
- A meta.json without consumed_samples (or with a field of the wrong type) fails
  inspect_checkpoint --verify and resume in one line, from one table of required fields
  (`read_resumable_meta`; a resume then falls back to an older checkpoint).
- --keep-last makes room before a save that lacks it (never deleting the newest checkpoint),
  and the free-space advice says what --keep-last does.
- A second job refused by the save lock has written nothing into --save (its tokenizer/ is
  untouched); the stored tokenizer record carries its fingerprint, and resuming with another
  vocabulary of the same size is refused naming both fingerprints (--finetune: a warning).
"""
import importlib.util
import logging
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from megazoo.data.tokenizers import TokenizerError, build_tokenizer
from tests.fixtures import small_gpt2
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint import storage
from megazoo.training.checkpoint.tokenizer import (check_run_tokenizer, read_record, store_training_tokenizer,
                                           tokenizer_dir)
from megazoo.training.config.run_config import CheckpointConfig, DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
META = dict(consumed_samples=8, skipped_steps=0, model={"vocab_size": 8}, layout={"tp": 1})


def _checkpoint(root, iteration, meta=META):
    tmp = ckpt.begin_offline(str(root), iteration)
    ckpt.write_rank_file(tmp, 0, {"w": torch.arange(4.0)})
    return ckpt.commit(str(root), iteration, 1, meta)


def _inspect(*argv):
    spec = importlib.util.spec_from_file_location("tool_inspect_checkpoint",
                                                  os.path.join(REPO, "tools", "inspect_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    old = sys.argv
    sys.argv = ["inspect_checkpoint.py", *argv]
    try:
        return module.main()
    finally:
        sys.argv = old


def test_garbage_latest_and_incomplete_meta_are_one_line(tmp_path, caplog, capsys):
    root = tmp_path / "save"
    first = _checkpoint(root, 1)
    (root / "latest").write_bytes(os.urandom(64))
    with caplog.at_level(logging.WARNING, logger="megazoo.training.checkpoint.format"):
        assert ckpt.latest_checkpoint(str(root)) == first
    assert any("no folder name" in r.getMessage() for r in caplog.records)
    shutil.rmtree(first)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.latest_checkpoint(str(root))
    assert "characters that are no folder name" in str(e.value) and "\n" not in str(e.value)
    assert _inspect(str(root)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and "latest" in err

    for broken, why in (({k: v for k, v in META.items() if k != "consumed_samples"}, "'consumed_samples'"),
                        (dict(META, layout=[1]), "'layout'")):
        folder = _checkpoint(tmp_path / f"m{len(why)}", 2, broken)
        with pytest.raises(ckpt.IntegrityError, match=why):  # what resume reads
            ckpt.read_resumable_meta(folder)
        assert _inspect(folder, "--verify") == 1
        assert why in capsys.readouterr().err


def test_keep_last_makes_room_before_the_save(tmp_path, monkeypatch, caplog):
    root = tmp_path / "save"
    folders = [_checkpoint(root, i) for i in (1, 2, 3)]
    need = storage.folder_bytes(folders[-1])
    capacity = int(need * 3.5)  # a disk that holds three checkpoints and a half

    def disk_usage(path):
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
        return SimpleNamespace(free=capacity - used)
    monkeypatch.setattr(storage.shutil, "disk_usage", disk_usage)
    problem = storage.free_space_problem(str(root), need, 1, folders[-1])
    assert problem is not None and "--keep-last N" in problem and "first deletes" in problem
    assert storage.make_room(str(root), ckpt.candidates(str(root)), need, 1, None, None) == []
    with caplog.at_level(logging.WARNING, logger="megazoo.training.checkpoint.storage"):
        deleted = storage.make_room(str(root), ckpt.candidates(str(root)), need, 1, 2, None)
    assert sorted(deleted) == folders[:2]  # --keep-last 2: the newest stays, the save makes two
    assert any("before saving" in r.getMessage() for r in caplog.records)
    # --keep-last 1 never deletes the only (newest) checkpoint before the new one exists
    assert storage.make_room(str(root), ckpt.candidates(str(root)), need, 1, 1, None) == []
    assert os.path.isdir(folders[-1])
    assert storage.free_space_problem(str(root), need, 1, folders[-1]) is None  # the save fits now


def _data(vocab, merges):
    return DataConfig(mock_data=True, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                      merge_file=merges)


def test_tokenizer_fingerprint_is_recorded_and_compared(tmp_path, caplog):
    mine, other = small_gpt2(str(tmp_path / "a")), small_gpt2(str(tmp_path / "b"), swap=("a", "b"))
    save = str(tmp_path / "save")
    store_training_tokenizer(_data(*mine), CheckpointConfig(save=save))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=mine[0], merge_file=mine[1])
    assert read_record(tokenizer_dir(save))["fingerprint"] == tok.fingerprint()
    check_run_tokenizer(tok, _data(*mine), CheckpointConfig(load=save))  # same tokenizer: fine
    swapped = build_tokenizer("GPT2BPETokenizer", vocab_file=other[0], merge_file=other[1])
    assert swapped.vocab_size == tok.vocab_size
    with pytest.raises(TokenizerError) as e:
        check_run_tokenizer(swapped, _data(*other), CheckpointConfig(load=save))
    assert tok.fingerprint() in str(e.value) and swapped.fingerprint() in str(e.value)
    with caplog.at_level(logging.WARNING, logger="megazoo.training.checkpoint.tokenizer"):
        check_run_tokenizer(swapped, _data(*other), CheckpointConfig(load=save, finetune=True))
    assert any("--finetune" in r.getMessage() for r in caplog.records)


def test_a_job_refused_by_the_lock_writes_nothing(tmp_path, capsys):
    from megazoo.training.run.entry import main
    mine, other = small_gpt2(str(tmp_path / "a")), small_gpt2(str(tmp_path / "b"), swap=("a", "b"))
    save = tmp_path / "save"
    store_training_tokenizer(_data(*mine), CheckpointConfig(save=str(save)))
    before = {f: (save / "tokenizer" / f).read_bytes() for f in os.listdir(save / "tokenizer")}
    lock = storage.SaveLock(str(save))  # the running job
    try:
        with pytest.raises(SystemExit) as e:
            main("gpt2", [
                "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
                "--seq-length", "8", "--max-position-embeddings", "8", "--train-iters", "1",
                "--mock-data", "--vocab-file", other[0], "--merge-file", other[1], "--save", str(save)])
    finally:
        lock.release()
    assert e.value.code == 1
    assert "in use by another job" in capsys.readouterr().err
    after = {f: (save / "tokenizer" / f).read_bytes() for f in os.listdir(save / "tokenizer")}
    assert after == before
