"""Qwen presets and training: each preset builds HF's parameter count (and the released
checkpoints' where known), and train_qwen.py trains Qwen3 (q/k norm, head_dim 2x hidden/heads) and
Qwen2 (QKV bias) with the same loss curve under dp, tp (with sequence parallelism) and pp.
Conversion and parity with transformers: tests/models/test_hf_configs.py."""
import dataclasses

import pytest
import torch

from megazoo.models.presets import PRESETS, preset
from tests.distributed import run_distributed
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

QWEN_PRESETS = [n for n, p in PRESETS.items() if p.get("family", "").startswith("qwen")
                and (p.get("add_qkv_bias") or p.get("qk_layernorm"))
                and not p.get("token_mixers")]  # hybrids: tests/models/test_hybrid_training.py
PUBLISHED = {"qwen2-0.5b": 494_032_768, "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920}


@pytest.mark.parametrize("name", QWEN_PRESETS)
def test_presets_build_the_hf_shapes(name):
    from megazoo.models.qwen2 import adapter as qwen2
    from megazoo.models.qwen2_moe import adapter as qwen2_moe
    from megazoo.models.qwen3 import adapter as qwen3
    from megazoo.models.qwen3_moe import adapter as qwen3_moe
    from transformers import AutoModelForCausalLM
    cfg = preset(name)
    module = ((qwen3_moe if cfg.qk_layernorm else qwen2_moe) if cfg.num_experts else
              (qwen3 if cfg.qk_layernorm else qwen2))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(module.hf_config(cfg))
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    assert module.config_from_hf(module.hf_config(cfg)) == cfg
    if name in PUBLISHED:
        assert cfg.num_parameters() == PUBLISHED[name]


TINY = ["--model", "qwen3-tiny", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--ffn-hidden-size", "48", "--seq-length", "16",
        "--mock-data", "--vocab-size", "61", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000",
        "--seed", "5", "--train-iters", "6", "--clip-grad", "0"]
LAYOUTS = [[], ["--pipeline-model-parallel-size", "2"],
           ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]]


def _worker(rank):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run.loop import pretrain
    curves = {}
    for qwen2 in (False, True):
        for i, layout in enumerate(LAYOUTS):
            run = to_run_config(build_parser("qwen3-tiny").parse_args(TINY + layout), world_size=2)
            assert run.model.kv_channels == 64 and run.model.qk_layernorm  # the preset's
            if qwen2:  # the same shape as Qwen2: QKV bias, no q/k norm, head_dim = hidden/heads
                run = dataclasses.replace(run, model=run.model.replace(
                    family="qwen2", qk_layernorm=False, add_qkv_bias=True, kv_channels=None))
            curves[(qwen2, i)] = pretrain(model_provider, run).losses
    return curves


def test_train_qwen_dp_pp_and_tp_give_the_same_loss_curve():
    curves = run_distributed(_worker, 2, timeout=400)[0]
    for qwen2 in (False, True):
        dp = curves[(qwen2, 0)]
        assert len(dp) == 6 and min(dp[1:]) < dp[0]
        for i in (1, 2):
            for a, b in zip(dp, curves[(qwen2, i)]):
                assert abs(a - b) <= 1e-5 * abs(a), (qwen2, i, dp, curves[(qwen2, i)])
