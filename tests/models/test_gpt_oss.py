"""gpt-oss, a family folder (models/gpt_oss/), against transformers' GptOssForCausalLM: a random
model with odd sizes and every field its config sets (alternating sliding/full layers, learned
attention sinks, q/k/v/o biases, YaRN without truncation, 6 experts (ep2 splits them) top-2 with router and expert
biases, the clamped SwiGLU with its alpha and limit, grouped-query attention with a decoupled
head_dim, untied head), fp32. Logits within 1e-5, greedy generation equal, export back
bit-identical; in one 2-rank world the tp2, ep2 and pp2 logits equal the unsharded model's."""
from __future__ import annotations

import pytest
import torch

from megazoo.models.gpt_oss import adapter
from megazoo.models.registry import build_model, family
from megazoo.parallel.sharding import gather_full_state_dict, load_full_state_dict
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed
from tests.hf_models import assert_config_round_trip, assert_equals_transformers, perturbed

VOCAB, SEQ = 97, 19
TOL = dict(rtol=0, atol=1e-5)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
        "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 5000.0}


def _hf_config(**overrides):
    from transformers import GptOssConfig
    fields = dict(
        vocab_size=VOCAB, hidden_size=44, intermediate_size=30, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, max_position_embeddings=64,
        rms_norm_eps=1e-5, sliding_window=5, num_local_experts=6, num_experts_per_tok=2,
        swiglu_alpha=1.5, swiglu_limit=3.0, router_aux_loss_coef=0.01, rope_parameters=YARN,
        tie_word_embeddings=False, initializer_range=0.05, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager", experts_implementation="eager")
    return GptOssConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair():
    from transformers import GptOssForCausalLM
    torch.manual_seed(0)
    hf = perturbed(GptOssForCausalLM(_hf_config()))
    cfg = adapter.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = ParallelTopology.single()
    model = build_model(cfg, topo).eval()
    load_full_state_dict(model, adapter.from_hf_state_dict(hf.state_dict(), cfg), topo)
    return hf, cfg, model


def test_config_maps_every_field_both_ways(pair):
    hf, cfg, model = pair
    assert cfg.family == "gpt_oss" and family("gpt_oss").adapter is adapter
    assert cfg.full_attention_layers == (1,) and cfg.sliding_window == 5
    spec = cfg.layer_spec(0)
    assert spec.mixer.sinks and spec.mixer.window == 5 and spec.mlp.kind == "moe"
    assert cfg.layer_spec(1).mixer.window is None
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    assert_config_round_trip(hf, cfg, adapter)
    with pytest.raises(ValueError, match="attention_bias"):
        adapter.config_from_hf(_hf_config(attention_bias=False))


def test_logits_generation_and_export_equal_transformers(pair):
    hf, cfg, model = pair
    assert_equals_transformers(hf, cfg, model, adapter, VOCAB, SEQ, TOL)

def _worker(rank, cfg, full, ids, ref):
    import torch.distributed as dist

    from megazoo.models.language_model import gather_logits
    worst = {}
    for name, layout in (("tp2", dict(tp=2)), ("ep2", dict(ep=2))):
        topo = ParallelTopology.from_config(ParallelConfig(**layout))
        model = build_model(cfg, topo).eval()
        load_full_state_dict(model, full, topo)
        with torch.no_grad():
            worst[name] = (gather_logits(model(ids), topo, VOCAB) - ref).abs().max().item()
    topo = ParallelTopology.from_config(ParallelConfig(pp=2, first_stage_layers=2))
    chunk = build_model(cfg, topo, pre_process=rank == 0, post_process=rank == 1,
                        layer_range=(0, 2) if rank == 0 else (2, cfg.num_layers)).eval()
    load_full_state_dict(chunk, full, topo)
    with torch.no_grad():
        if rank == 0:
            dist.send(chunk(ids).contiguous(), 1)
            return worst
        h = torch.empty(SEQ, ids.shape[0], cfg.hidden_size)
        dist.recv(h, 0)
        worst["pp2"] = (chunk(h)[..., :VOCAB] - ref).abs().max().item()
    return worst


def test_tp2_ep2_and_pp2_equal_the_unsharded_model(pair):
    _, cfg, model = pair
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)[..., :VOCAB]
    full = gather_full_state_dict(model, ParallelTopology.single())
    worst = run_distributed(_worker, 2, cfg, full, ids, ref, timeout=300)
    assert max(worst[0].values()) < 1e-5, worst
    assert set(worst[1]) == {"tp2", "ep2", "pp2"} and max(worst[1].values()) < 1e-5, worst


@pytest.mark.parametrize("name", ("gpt-oss-20b", "gpt-oss-tiny"))
def test_presets_build_the_hf_parameter_count(name):
    from transformers import AutoModelForCausalLM

    from megazoo.models.presets import preset
    cfg = preset(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(adapter.hf_config(cfg))
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    assert adapter.config_from_hf(adapter.hf_config(cfg)).computed_fields() == cfg.computed_fields()
