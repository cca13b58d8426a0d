"""A checkpoint records which optimizer state it holds; a resume that would load it into an
optimizer keeping other states (another --optimizer, other --muon-adamw-params) is refused in
one line naming the flag, before any tensor is read; --no-load-optim and --finetune still load
the weights."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import TINY, pretrain_gpt
from megazoo.training.checkpoint.format import CheckpointError

SMALL = TINY[:1] + ["2"] + TINY[2:]  # --num-layers 2
MUON = ["--optimizer", "muon", "--muon-ns-dtype", "fp32"]


def test_changed_optimizer_or_adamw_params_refused_before_loading(tmp_path):
    root = str(tmp_path / "ckpt")
    pretrain_gpt(SMALL + MUON + ["--train-iters", "1", "--save", root], 1)
    meta = json.load(open(os.path.join(root, "iter_0000001", "meta.json")))
    assert meta["optimizer"] == {"name": "muon", "muon_adamw_params": ["embedding", "head_weight"]}
    more = MUON + ["--muon-adamw-params", "embedding", "head_weight", "fc2"]
    with pytest.raises(CheckpointError, match=r"^--muon-adamw-params embedding head_weight fc2 "
                       r"differs from embedding head_weight in .*iter_0000001.*pass "
                       r"--muon-adamw-params embedding head_weight, or --finetune"):
        pretrain_gpt(SMALL + more + ["--train-iters", "2", "--load", root], 1)
    with pytest.raises(CheckpointError, match=r"holds muon optimizer state, this run uses "
                                              r"--optimizer adamw; pass --optimizer muon"):
        pretrain_gpt(SMALL + ["--train-iters", "2", "--load", root], 1)
    # Without the optimizer state the weights load into the new split.
    result = pretrain_gpt(SMALL + more + ["--train-iters", "2", "--load", root,
                                          "--no-load-optim"], 1)
    assert len(result.losses) == 1
