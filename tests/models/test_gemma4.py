"""Gemma 4 text, a family folder (models/gemma4_text/), against transformers' Gemma4ForCausalLM:
a random model with odd sizes and the features megazoo models on (5:1 sliding/full layers with
two RoPE bases, "proportional" partial RoPE on the full ones, grouped-query attention with a
decoupled head_dim and the full layers' own (global_head_dim), value norm, per-layer scalars (perturbed away from 1), softmax scale 1,
final logit softcapping, untied head), fp32; each unmodelled feature is refused in one line.
Logits within 1e-5, greedy generation equal, export back bit-identical; in one 2-rank world the
tp2 and pp2 logits equal the unsharded model's."""
from __future__ import annotations

import pytest
import torch

from megazoo.models.gemma4_text import adapter
from megazoo.models.registry import build_model, family
from megazoo.parallel.sharding import gather_full_state_dict, load_full_state_dict
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed
from tests.hf_models import assert_config_round_trip, assert_equals_transformers, perturbed

VOCAB, SEQ = 97, 19
TOL = dict(rtol=0, atol=1e-5)


def _hf_config(**overrides):
    from transformers import Gemma4TextConfig
    fields = dict(
        vocab_size=VOCAB, hidden_size=44, intermediate_size=70, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, max_position_embeddings=64,
        rms_norm_eps=1e-6, sliding_window=5, global_head_dim=14,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3
        + ["full_attention"],
        hidden_size_per_layer_input=0,
        rope_parameters={"full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.5, "factor": 2.0,
                                            "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 777.0}},
        final_logit_softcapping=7.0, tie_word_embeddings=False,
        initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Gemma4TextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair():
    from transformers import Gemma4ForCausalLM
    torch.manual_seed(0)
    hf = perturbed(Gemma4ForCausalLM(_hf_config()))
    with torch.no_grad():  # transformers keeps the scalars as buffers (perturbed moves parameters)
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.75 + 0.1 * i)
    cfg = adapter.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = ParallelTopology.single()
    model = build_model(cfg, topo).eval()
    load_full_state_dict(model, adapter.from_hf_state_dict(hf.state_dict(), cfg), topo)
    return hf, cfg, model


def test_config_maps_every_field_both_ways(pair):
    hf, cfg, _ = pair
    assert cfg.family == "gemma4_text" and family("gemma4_text").adapter is adapter
    assert cfg.full_attention_layers == (2, 6) and cfg.sliding_window == 5
    assert cfg.layer_spec(0).mixer.rope_theta == 777.0 and cfg.layer_spec(0).mixer.rope_scaling is None
    assert cfg.layer_spec(6).mixer.rope_scaling == {"rope_type": "proportional",
                                                    "partial_rotary_factor": 0.5, "factor": 2.0}
    assert cfg.global_kv_channels == 14 and cfg.layer_spec(6).mixer.head_dim == 14
    assert cfg.layer_spec(0).mixer.head_dim is None
    spec = cfg.layer_spec(0)
    assert spec.mixer.v_norm and spec.scalar and spec.mixer.scale == 1.0
    assert_config_round_trip(hf, cfg, adapter)
    for field, value in (("hidden_activation", "silu"), ("attention_bias", True),
                         ("hidden_size_per_layer_input", 8), ("num_kv_shared_layers", 2),
                         ("enable_moe_block", True),
                         ("use_bidirectional_attention", "all")):
        with pytest.raises(ValueError, match=f"^Gemma4 config.json: {field}="):
            adapter.config_from_hf(_hf_config(**{field: value}))


def test_logits_generation_and_export_equal_transformers(pair):
    hf, cfg, model = pair
    assert_equals_transformers(hf, cfg, model, adapter, VOCAB, SEQ, TOL)

def _worker(rank, cfg, full, ids, ref):
    import torch.distributed as dist

    from megazoo.models.language_model import gather_logits
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    model = build_model(cfg, topo).eval()
    load_full_state_dict(model, full, topo)
    with torch.no_grad():
        tp = gather_logits(model(ids), topo, VOCAB)
    worst = {"tp2": (tp - ref).abs().max().item()}
    topo = ParallelTopology.from_config(ParallelConfig(pp=2, first_stage_layers=4))
    split = 4
    chunk = build_model(cfg, topo, pre_process=rank == 0, post_process=rank == 1,
                        layer_range=(0, split) if rank == 0 else (split, cfg.num_layers)).eval()
    load_full_state_dict(chunk, full, topo)
    with torch.no_grad():
        if rank == 0:
            dist.send(chunk(ids).contiguous(), 1)
            return worst
        h = torch.empty(SEQ, ids.shape[0], cfg.hidden_size)
        dist.recv(h, 0)
        worst["pp2"] = (chunk(h)[..., :VOCAB] - ref).abs().max().item()
    return worst


def test_tp2_and_pp2_equal_the_unsharded_model(pair):
    _, cfg, model = pair
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)[..., :VOCAB]
    full = gather_full_state_dict(model, ParallelTopology.single())
    worst = run_distributed(_worker, 2, cfg, full, ids, ref, timeout=300)[1]
    assert set(worst) == {"tp2", "pp2"} and max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("name", ("gemma4-tiny",))
def test_presets_build_the_hf_parameter_count(name):
    from transformers import AutoModelForCausalLM

    from megazoo.models.presets import preset
    cfg = preset(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(adapter.hf_config(cfg))
    # transformers keeps each layer's scalar as a buffer, megazoo as a parameter
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
    assert sum(p.numel() for p in hf.parameters()) + scalars == cfg.num_parameters()
    assert adapter.config_from_hf(adapter.hf_config(cfg)).computed_fields() == cfg.computed_fields()


def test_released_vision_bidirectional_setting_is_causal_over_text(pair):
    """The releases' use_bidirectional_attention "vision" opens the mask among image tokens only:
    on text transformers computes the causal model, which the import builds."""
    from transformers import Gemma4ForCausalLM
    hf, cfg, model = pair
    vision = Gemma4ForCausalLM(_hf_config(use_bidirectional_attention="vision")).eval()
    vision.load_state_dict(hf.state_dict())
    assert adapter.config_from_hf(vision.config).replace(make_vocab_size_divisible_by=8) == cfg
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :VOCAB], vision(ids).logits, **TOL)
