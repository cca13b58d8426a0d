"""Flags that used to be accepted silently: refused in one line at the flags, or said once.

- LR warmup longer than an explicit --lr-decay-iters is refused (as Megatron's scheduler); warmup
  longer than this run is one warning with the LR the run reaches (8e-05 of 1e-3 for 4 of 50
  warmup iterations), with or without --lr-decay-iters.
- --vocab-size with a tokenizer is ignored with a warning naming both sizes.
- --save pointing at a file (or below one) is refused at the flags, not at every rank's makedirs.
- A head_dim RoPE cannot split (hidden 90, 6 heads: 15) is refused at the flags.
"""
import logging

import pytest

from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--mock-data", "--vocab-size", "64"]


def _config(*extra, vocab_size=None):
    return to_run_config(build_parser().parse_args(TINY + list(extra)), vocab_size=vocab_size,
                         world_size=1)


def _refused(*extra) -> str:
    """The one-line error (ArgumentError, or the model config's ValueError: both exit 2 with the
    line at training/run/entry.py, before any process group)."""
    with pytest.raises(ValueError) as e:
        _config(*extra)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_refused_at_the_flags(tmp_path):
    assert "exceeds --lr-decay-iters 10" in _refused(
        "--train-iters", "4", "--lr-decay-iters", "10", "--lr-warmup-iters", "11")
    assert _config("--train-iters", "4", "--lr-decay-iters", "4",
                   "--lr-warmup-iters", "4").schedule.lr_warmup_iters == 4
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for path in (a_file, a_file / "below"):
        msg = _refused("--train-iters", "1", "--save", str(path))
        assert msg.startswith(f"--save {path}: {a_file} is a file")
    assert "head_dim 15" in _refused("--train-iters", "1", "--hidden-size", "90",
                                     "--num-attention-heads", "6", "--position-embedding-type", "rope")


def test_said_once(caplog):
    with caplog.at_level(logging.WARNING, logger="megazoo.train"):
        run = _config("--train-iters", "4", "--lr-decay-iters", "100", "--lr-warmup-iters", "50")
        _config("--train-iters", "4", "--lr-warmup-iters", "50")
        _config("--train-iters", "4", "--tokenizer-type", "GPT2BPETokenizer", vocab_size=50257)
    assert run.schedule.lr_warmup_iters == 50
    lines = [r.getMessage() for r in caplog.records]
    warmup = [m for m in lines if "outlasts --train-iters 4" in m and "8e-05 of --lr 0.001" in m]
    assert len(warmup) == 2 and ["defaults to --train-iters" in m for m in warmup] == [False, True], lines
    assert any(m.startswith("--vocab-size 64 ignored") and "50257" in m for m in lines), lines
    assert len(lines) == 3
