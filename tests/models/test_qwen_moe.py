"""megazoo Qwen2-MoE and Qwen3-MoE against Hugging Face `Qwen2MoeForCausalLM` /
`Qwen3MoeForCausalLM` with the same random weights (fp32):

random configs (Qwen2-MoE: QKV bias, gated shared expert, dense layers 1 and 3 via mlp_only_layers
= --moe-layer-freq 2, untied; Qwen3-MoE: q/k norm, head_dim 16 != 32/4, 8 experts top-3
renormalised, tied; vocabulary 101) go through import -> export: tensors bit-identical to
`save_pretrained`'s, the in-memory fused form imports the same, `from_pretrained` of the export
gives identical logits; at tp1 logits within 1e-5 and greedy generation equal to `generate`; one
4-rank world loads the imported checkpoints under (tp2, ep2), (ep4) and (pp2, ep2): logits within
1e-5 (greedy generation too with pp 1). Unmodelled fields are refused in one line naming the
field, before anything is written; released config.json files and the presets give HF's
parameter counts.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import NEW_TOKENS, check_against_hf, round_trip_cases

VOCAB = 101
LAYOUTS = [dict(tp=2, ep=2), dict(ep=4), dict(pp=2, ep=2)]
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=24,
             num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _qwen2_moe(model=True, **kw):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    config = Qwen2MoeConfig(**{**_BASE, "shared_expert_intermediate_size": 20, **kw})
    return Qwen2MoeForCausalLM(config) if model else config


def _qwen3_moe(model=True, **kw):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(**{**_BASE, **kw})
    return Qwen3MoeForCausalLM(config) if model else config


SUPPORTED = {  # name: (builder, non-default fields)
    "qwen2-moe-shared-dense-1-3-untied": (_qwen2_moe, dict(mlp_only_layers=[1, 3],
                                                          router_aux_loss_coef=0.02)),
    "qwen3-moe-e8-top3-norm-head-dim-16-tied": (_qwen3_moe, dict(
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, head_dim=16,
        num_hidden_layers=2, tie_word_embeddings=True)),
}
REFUSED = {  # name: (builder, fields, the field the error must name)
    "qwen2-moe-sparse-step": (_qwen2_moe, dict(decoder_sparse_step=2), "decoder_sparse_step"),
    "qwen2-moe-mlp-only-layer-0": (_qwen2_moe, dict(mlp_only_layers=[0]), "mlp_only_layers"),
    "qwen2-moe-mlp-only-irregular": (_qwen2_moe, dict(mlp_only_layers=[1]), "mlp_only_layers"),
    "qwen2-moe-no-shared-expert": (_qwen2_moe, dict(shared_expert_intermediate_size=0),
                                   "shared_expert_intermediate_size"),
    "qwen2-moe-sliding-window": (_qwen2_moe, dict(use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=2), "layer_types"),
    "qwen2-moe-gelu": (_qwen2_moe, dict(hidden_act="gelu"), "hidden_act"),
    "qwen3-moe-attention-bias": (_qwen3_moe, dict(attention_bias=True), "attention_bias"),
    "qwen3-moe-sliding-window": (_qwen3_moe, dict(use_sliding_window=True), "use_sliding_window"),
    "qwen3-moe-no-experts": (_qwen3_moe, dict(num_experts=0), "num_experts"),
    "qwen3-moe-unknown-field": (_qwen3_moe, dict(use_fancy_router=True), "use_fancy_router"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unmodelled_fields_are_refused_naming_the_field(name, tmp_path):
    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.training.checkpoint.hf import ConversionError, import_hf
    build, fields, field = REFUSED[name]
    build(model=False, **fields).save_pretrained(tmp_path / "hf")  # refused before weights are read
    with pytest.raises((ConversionError, UnsupportedConfigError), match=rf"^[^\n]*{field}=[^\n]*$"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "mz"))
    assert not (tmp_path / "mz").exists()


def _world(rank, cases):
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    torch.use_deterministic_algorithms(True)
    errors, checked = [0.0], []
    for kw in LAYOUTS:  # one topology per layout: creating groups is slow
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        for case in cases:
            errors.append(check_against_hf(case, topo, NEW_TOKENS)[1])
            checked.append((case["name"], str(kw)))
    return max(errors), checked


def test_round_trip_and_logits_and_generation_under_tp_pp_ep(tmp_path):
    from safetensors.torch import load_file

    from megazoo.models.registry import family, model_class
    from megazoo.parallel.topology import ParallelTopology
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    cases, models = round_trip_cases(SUPPORTED, tmp_path, ids, ids[:, :5])
    for case, hf in zip(cases, models):
        # the files too: export writes the per-expert form save_pretrained writes
        files, exported = (load_file(f"{case[d]}/model.safetensors") for d in ("hf_dir", "out"))
        assert exported.keys() == files.keys(), case["name"]
        for k in files:
            assert torch.equal(exported[k], files[k]), (case["name"], k)
        # transformers 5's in-memory form (fused gate_up_proj) imports the same tensors
        adapter = family(case["family"]).adapter
        from_memory = adapter.from_hf_state_dict(hf.state_dict(), case["config"])
        assert from_memory.keys() == case["full"].keys()
        for k, v in from_memory.items():
            assert torch.equal(v, case["full"][k]), (case["name"], k)
        assert sum(p.numel() for p in hf.parameters()) == case["config"].num_parameters()
        check_against_hf(case, ParallelTopology.single(), NEW_TOKENS)  # tp1: logits and greedy
    assert [model_class(c["config"]).__name__ for c in cases] == ["Qwen2MoeModel", "Qwen3MoeModel"]
    results = run_distributed(_world, 4, cases, timeout=500)
    print("max |logits - transformers| over ranks and layouts:", max(e for e, _ in results))
    assert max(e for e, _ in results) <= 1e-5
    assert len(results[0][1]) == len(SUPPORTED) * len(LAYOUTS)


def test_layer_placement_maps_onto_moe_layer_freq():
    from megazoo.models.qwen2_moe import adapter as qwen2_moe
    cfg = qwen2_moe.config_from_hf(_qwen2_moe(model=False, num_hidden_layers=6,
                                              mlp_only_layers=[1, 2, 4, 5, 9]))
    assert cfg.moe_layer_freq == 3 and cfg.moe_aux_loss_coeff == pytest.approx(0.002)
    back = qwen2_moe.hf_config(cfg)
    assert (back.mlp_only_layers, back.decoder_sparse_step) == ([1, 2, 4, 5], 1)
    # megazoo's default router (softmax over the top-k logits) exports as norm_topk_prob=True
    assert qwen2_moe.hf_config(cfg.replace(moe_router_pre_softmax=False)).norm_topk_prob
    with pytest.raises(ValueError, match="HF Qwen2-MoE cannot express no shared expert"):
        qwen2_moe.hf_config(cfg.replace(moe_shared_expert_intermediate_size=None,
                                        moe_shared_expert_gate=False))


# config.json of the released checkpoints (Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B), as published
RELEASED = {
    "qwen2-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151643, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
        intermediate_size=5632, max_position_embeddings=8192, max_window_layers=21,
        model_type="qwen2_moe", num_attention_heads=16, num_hidden_layers=24,
        num_key_value_heads=16, rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768,
        tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.40.0.dev0",
        use_cache=True, use_sliding_window=False, vocab_size=151936, decoder_sparse_step=1,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts_per_tok=4,
        num_experts=60, norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.001),
    "qwen3-moe-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645, head_dim=128,
        hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=6144,
        max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
        model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
        num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.51.0",
        use_cache=True, use_sliding_window=False, vocab_size=151936),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configs_and_presets_match_hf_shapes(name, tmp_path):
    """The released config.json imports; its parameter count, the preset's and HF's model from the
    exported preset config (on meta) agree: Qwen1.5-MoE-A2.7B 14.32B total / 2.69B active,
    Qwen3-30B-A3B 30.53B / 3.35B (published: 14.3B / 2.7B and 30.5B / 3.3B)."""
    from transformers import AutoModelForCausalLM

    from megazoo.models.presets import preset
    from megazoo.training.checkpoint.hf import read_hf_config
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    _, module, hf = read_hf_config(str(tmp_path))
    imported = module.config_from_hf(hf)
    cfg = preset(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(module.hf_config(cfg))
    total = sum(p.numel() for p in model.parameters())
    assert imported.num_parameters() == cfg.num_parameters() == total
    assert (imported.add_qkv_bias, imported.qk_layernorm) == (cfg.add_qkv_bias, cfg.qk_layernorm)
    expected = {"qwen2-moe-a2.7b": (14.32, 2.69), "qwen3-moe-30b-a3b": (30.53, 3.35)}[name]
    assert (round(total / 1e9, 2), round(cfg.num_parameters(active=True) / 1e9, 2)) == expected
