"""YaRN RoPE scaling for multi-latent attention (models/mla.py) against transformers' DeepSeek-V3.

A random DeepSeek-V3 (one dense layer, two MoE layers) whose rope_parameters are YaRN with factor
4 over an original length of 8, `mscale` and `mscale_all_dim` both set and unequal (so cos/sin
carry an attention factor != 1 and the softmax scale the correction mscale(4, mscale_all_dim)^2),
beta_fast low enough that the ramp blends the rope channels: logits equal transformers' within
fp32 1e-5 on sequences shorter and longer than the original length, in both RoPE layouts
(interleaved pairs, halves); without the scaling they differ; the HF config round trip keeps
rope_parameters; the length-dependent scalings are refused in one line.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.parallel.topology import ParallelTopology
from tests.hf_models import hf_deepseek_v3

TOL = dict(rtol=1e-5, atol=1e-5)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.7, "mscale_all_dim": 1.3, "beta_fast": 4, "beta_slow": 1, "rope_theta": 500.0}


def _converted(hf):
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    from megazoo.models.deepseek_v3.model import DeepseekV3Model
    from megazoo.parallel.sharding import load_full_state_dict
    cfg = deepseek_v3.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = ParallelTopology.single()
    model = DeepseekV3Model(cfg, topo).eval()
    load_full_state_dict(model, deepseek_v3.from_hf_state_dict(hf.state_dict(), cfg), topo)
    return cfg, model


@pytest.mark.parametrize("interleave", [True, False])
def test_yarn_latent_attention_logits_equal_transformers(interleave):
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    from megazoo.models.deepseek_v3.model import DeepseekV3Model
    from megazoo.models.rope import attention_factor, latent_softmax_scale
    hf = hf_deepseek_v3(max_position_embeddings=32, qk_rope_head_dim=8, rope_interleave=interleave,
                        rope_parameters=dict(YARN))
    cfg, model = _converted(hf)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    assert attention_factor(cfg.rope_scaling, 32) != pytest.approx(1.0, abs=0.01)
    assert latent_softmax_scale(cfg.rope_scaling, 32) > 1.3
    plain = DeepseekV3Model(cfg.replace(rope_scaling=None), ParallelTopology.single())
    plain.load_state_dict(model.state_dict())
    plain.eval()
    for seq in (6, 20):  # within and past the original 8 positions
        ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            ours = model(ids)[..., :96]
            torch.testing.assert_close(ours, hf(ids).logits, **TOL, msg=f"s={seq}")
            assert (plain(ids)[..., :96] - ours).abs().max() > 1e-3  # the scaling matters
    back = deepseek_v3.hf_config(cfg)
    assert back.rope_parameters == hf.config.rope_parameters
    assert deepseek_v3.config_from_hf(back) == deepseek_v3.config_from_hf(hf.config)


def test_length_dependent_scalings_are_refused_by_latent_attention():
    from megazoo.models.init import Initializer
    from megazoo.models.mla import MultiLatentAttention
    from megazoo.models.presets import preset
    cfg = preset("deepseek-v3-tiny", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' with multi-latent attention") as e:
        MultiLatentAttention(cfg, ParallelTopology.single(), Initializer(cfg),
                             "layers.0.attention.", None)
    assert "\n" not in str(e.value)
