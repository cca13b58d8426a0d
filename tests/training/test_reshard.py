"""Checkpoints across layouts, in spawned gloo worlds (fp32):

- saved under (tp2, pp2, dp1, ZeRO-1), loaded under (tp4, pp1, dp1) directly and under
  (tp1, pp1, dp2, ZeRO-2) directly and through tools/reshard.py: the next iteration's loss equals
  the unchanged layout's continuation (1e-5); likewise (dp2, ZeRO-2) -> (tp2, ZeRO-1);
- --finetune from an imported GPT-2 or BLOOM (weights only) under any tp/pp/dp/ZeRO: the first
  loss equals transformers' loss on the same batch (1e-5); iteration and optimizer start at zero.
"""
import os
import sys

import torch

from tests.distributed import run_distributed
from tests.helpers import TINY, pretrain_gpt
from tests.hf_models import hf_gpt2
from tests.tolerances import assert_curves_close

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--zero-stage", "1"]
TP4 = ["--tensor-model-parallel-size", "4"]
DP2 = ["--zero-stage", "2"]


def _pretrain_bloom(argv, world):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    run = to_run_config(build_parser("bloom-560m").parse_args(argv), world_size=world)
    return pretrain(model_provider, run)


def _world4(rank, root, imported, imported_bloom):
    saved = pretrain_gpt(TINY + TP2PP2 + ["--train-iters", "3", "--save", root], 4)
    cont = pretrain_gpt(TINY + TP2PP2 + ["--train-iters", "4", "--load", root], 4)
    tp4 = pretrain_gpt(TINY + TP4 + ["--train-iters", "4", "--load", root], 4)
    fine = pretrain_gpt(TINY + ["--zero-stage", "2", "--train-iters", "2", "--load", imported,
                                "--finetune"], 4)
    fine_tp = pretrain_gpt(TINY + TP2PP2 + ["--train-iters", "2", "--load", imported, "--finetune"], 4)
    again = pretrain_gpt(TINY + TP4 + ["--train-iters", "2", "--load", root, "--finetune"], 4)
    bloom = _pretrain_bloom(TINY + TP2PP2 + ["--train-iters", "1", "--load", imported_bloom,
                                             "--finetune"], 4)
    return dict(bloom=bloom.losses, saved=saved.losses, cont=cont.losses, cont_it=cont.state.iteration,
                tp4=tp4.losses, fine=fine.losses, fine_it=fine.state.iteration,
                fine_tp=fine_tp.losses, again=again.losses, again_it=again.state.iteration)


def _world2(rank, root, tool_root, root_dp2, saves):
    direct = pretrain_gpt(TINY + DP2 + ["--train-iters", "4", "--load", root, "--save", root_dp2], 2)
    tool = pretrain_gpt(TINY + DP2 + ["--train-iters", "4", "--load", tool_root], 2)
    # a ZeRO-2 checkpoint whose optimizer states are split over 2 data-parallel ranks, continued
    # under ZeRO-2 (same layout), (tp2, ZeRO-1) and ZeRO-3; each saves iteration 5
    cont = pretrain_gpt(TINY + DP2 + ["--train-iters", "5", "--load", root_dp2, "--save", saves[0]], 2)
    tp2 = pretrain_gpt(TINY + ["--tensor-model-parallel-size", "2", "--zero-stage", "1",
                               "--train-iters", "5", "--load", root_dp2, "--save", saves[1]], 2)
    z3 = pretrain_gpt(TINY + ["--zero-stage", "3", "--train-iters", "5", "--load", root_dp2,
                              "--save", saves[2]], 2)
    return direct.losses, tool.losses, tool.state.iteration, cont.losses, tp2.losses, z3.losses


def test_reshard_and_finetune(tmp_path):
    from megazoo.training.checkpoint.hf import import_hf
    root, imported = str(tmp_path / "run"), str(tmp_path / "imported")
    hf_loss = hf_gpt2(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), imported, tp=2, pp=2)
    bloom_loss = hf_gpt2(str(tmp_path / "hf_bloom"), bloom=True)
    import_hf(str(tmp_path / "hf_bloom"), imported + "_bloom", tp=4)
    r = run_distributed(_world4, 4, root, imported, imported + "_bloom", timeout=400)[0]

    # Same layout: exact resume; the reference for the other layouts is its 4th loss.
    assert r["cont_it"] == 4 and len(r["cont"]) == 1
    ref = r["cont"][0]
    assert abs(r["tp4"][0] - ref) <= 1e-5, (r["tp4"], ref)

    tool_root = str(tmp_path / "resharded")
    import subprocess
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools/reshard.py"), "--load", root,
                          "--save", tool_root, "--data-parallel-size", "2", "--zero-stage", "2"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))))
    assert out.returncode == 0, out.stderr
    saves = [str(tmp_path / f"iter5_{k}") for k in ("zero2", "tp2", "zero3")]
    direct, tool, it, cont, tp2, z3 = run_distributed(_world2, 2, root, tool_root,
                                                      str(tmp_path / "dp2"), saves, timeout=300)[0]
    assert it == 4 and len(tool) == 1
    assert abs(direct[0] - ref) <= 1e-5 and abs(tool[0] - ref) <= 1e-5, (direct, tool, ref)
    assert len(cont) == len(tp2) == len(z3) == 1, (cont, tp2, z3)
    assert abs(cont[0] - tp2[0]) <= 1e-5 and abs(cont[0] - z3[0]) <= 1e-5, (cont, tp2, z3)
    # The three layouts' iteration-5 checkpoints export to the same Hugging Face tensors (ZeRO-3
    # keeps its weights only in the optimizer's shards).
    from safetensors.torch import load_file

    from megazoo.training.checkpoint.hf import export_hf
    exported = [load_file(os.path.join(export_hf(s, s + "_hf"), "model.safetensors")) for s in saves]
    for other in exported[1:]:
        assert other.keys() == exported[0].keys()
        for k in other:
            torch.testing.assert_close(other[k], exported[0][k], rtol=0, atol=1e-6)

    # --finetune: imported weights, iteration 0, fresh optimizer, under two layouts.
    assert r["fine_it"] == 2 and len(r["fine"]) == 2
    assert abs(r["fine"][0] - hf_loss) <= 1e-5, (r["fine"], hf_loss)
    assert_curves_close(r["fine_tp"], r["fine"], "finetune under tp", atol=1e-5)
    # ... and BLOOM through train_bloom's model provider: (tp4) import -> (tp2, pp2, ZeRO-1) run
    assert len(r["bloom"]) == 1 and abs(r["bloom"][0] - bloom_loss) <= 1e-5, (r["bloom"], bloom_loss)
    # --finetune from a trained checkpoint: its weights (lower loss on batch 0 than at
    # initialisation), but iteration and data position restart at 0
    assert r["again_it"] == 2 and len(r["again"]) == 2
    assert r["again"][0] < r["saved"][0] - 1e-3, (r["again"], r["saved"])
