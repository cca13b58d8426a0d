"""MoE checkpoints across expert-parallel layouts, in one 4-rank gloo world (fp32, train_moe.py):

saved under (ep2, ZeRO-1) after 3 iterations; the 4th and 5th iterations' losses are the same
whether the run continues in that layout, or loads it (weights and optimizer states through full tensors)
under (ep4, ZeRO-2), (tp2, ep2, ZeRO-0), or from a copy written offline for (ep4, ZeRO-3) by
tools/reshard.py (1e-5). Experts are read from each expert-parallel rank and joined.
"""
from __future__ import annotations

import os

from tests.distributed import run_distributed

TINY_MOE = ["--model", "moe-tiny", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24",
            "--num-experts", "4", "--seq-length", "16", "--mock-data", "--vocab-size", "61",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000",
            "--seed", "5"]


def _pretrain(argv, world=4):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    run = to_run_config(build_parser("moe-tiny").parse_args(argv), world_size=world)
    return pretrain(model_provider, run)


def _world(rank, root, resharded):
    ep2 = ["--expert-model-parallel-size", "2", "--zero-stage", "1"]
    _pretrain(TINY_MOE + ep2 + ["--train-iters", "3", "--save", root])
    if rank == 0:
        from megazoo.tools.reshard import reshard
        reshard(root, resharded, tp=1, pp=1, dp=4, zero_stage=3, ep=4)
    import torch.distributed as dist
    dist.barrier()
    out = {}
    for name, layout, load in (
            ("same", ep2, root),
            ("ep4 zero2", ["--expert-model-parallel-size", "4", "--zero-stage", "2"], root),
            ("tp2 ep2 zero0", ["--tensor-model-parallel-size", "2",
                               "--expert-model-parallel-size", "2"], root),
            ("tool ep4 zero3", ["--expert-model-parallel-size", "4", "--zero-stage", "3"],
             resharded)):
        result = _pretrain(TINY_MOE + layout + ["--train-iters", "5", "--load", load])
        out[name] = (result.state.iteration, result.losses)
    return out


def test_moe_checkpoints_across_expert_layouts(tmp_path):
    root, resharded = str(tmp_path / "run"), str(tmp_path / "resharded")
    r = run_distributed(_world, 4, root, resharded, timeout=500)[0]
    it, ref = r["same"]
    assert it == 5 and len(ref) == 2
    for name, (it, losses) in r.items():
        assert it == 5 and len(losses) == 2, (name, losses)
        for a, b in zip(losses, ref):  # the 5th loss depends on the loaded optimizer states
            assert abs(a - b) <= 1e-5, (name, losses, ref)
    assert os.path.isdir(resharded)
