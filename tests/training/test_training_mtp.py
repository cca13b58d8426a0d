"""A DeepSeek-V3 run with --mtp-num-layers: the logged metrics keep the main loss apart from the
multi-token prediction loss (`mtp_loss` = --mtp-loss-scaling-factor x the mean of the depths'
`mtp_k_loss`), the checkpoint carries the depths' weights; Megatron's formats, which megazoo
maps no depths for, refuse them both ways in one line."""
from __future__ import annotations

import json
import math

import pytest

from tests.helpers import TINY, one_thread, pretrain_gpt  # noqa: F401 - one_thread: autouse


def test_a_run_logs_the_mtp_losses_apart_from_the_main_loss(tmp_path):
    run = pretrain_gpt(["--model", "deepseek-v3-tiny", *TINY, "--num-layers", "2",
                        "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
                        "--train-iters", "2", "--log-interval", "1", "--save", str(tmp_path),
                        "--save-interval", "2"], 1)
    assert run.state.iteration == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 2
    for r in train:
        depths = [r["mtp_1_loss"], r["mtp_2_loss"]]
        assert all(math.isfinite(d) and 2 < d < 8 for d in depths), r  # near ln(61) at the start
        assert math.isclose(r["mtp_loss"], 0.3 * sum(depths) / 2, rel_tol=1e-9)
        assert r["loss"] not in depths and abs(r["loss"] - r["mtp_loss"]) > 1  # the main loss alone
    from safetensors import safe_open
    folder = tmp_path / "iter_0000002"
    assert json.loads((folder / "meta.json").read_text())["model"]["mtp_num_layers"] == 2
    with safe_open(str(folder / "rank_00000.safetensors"), "pt") as f:
        names = set(f.keys())
    for d in range(2):
        assert {f"model.0.mtp.depths.{d}.eh_proj.weight",
                f"model.0.mtp.depths.{d}.layer.mlp.expert_bias"} <= names
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint
    with pytest.raises(ckpt.CheckpointError, match="'deepseek_v3' has no Megatron-core layout") as e:
        export_checkpoint("megatron-dist", str(tmp_path), str(tmp_path / "megatron"))
    assert "\n" not in str(e.value)
    # (Megatron-LM's MTP runs import: tests/training/test_checkpoint_megatron_mla.py)
