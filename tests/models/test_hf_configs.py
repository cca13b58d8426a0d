"""Every Hugging Face config field is modelled or refused; Qwen2 and Qwen3 both ways (fp32).

Random HF models with a non-default value of one field each (GPT-2 untied head, both attention
scaling flags, exact GELU, n_inner; BLOOM untied; Llama decoupled head_dim) and random Qwen2 /
Qwen3 models (GQA, MQA, tied and untied, odd vocabulary 101, Qwen3 head_dim != hidden/heads) go
through `import_hf` -> `export_hf`: the exported tensors equal HF's bit for bit and transformers'
`from_pretrained` of the export gives HF's logits exactly. One spawned 4-rank world then loads every
imported checkpoint under (tp2, pp2) and (tp4): logits within 1e-5 of transformers; at tp4, greedy
generation equals `generate(do_sample=False)`; Qwen3's (replicated) q/k-norm gradients under tp2
and tp4 (with sequence parallelism) equal the unsharded model's. Fields that change the math and
are not modelled are refused in one line naming the field. The config.json files of 46 released
checkpoints (every family) import with transformers' parameter counts or are refused in one line;
one shrunk copy per released structure (a multimodal release's text model: Qwen3.5-MoE) gives
transformers' logits within 1e-5 (one process).
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import NEW_TOKENS, perturbed, round_trip_cases

VOCAB = 101
LAYERS = 2  # one per stage at pp2: still a stage whose layers do not start at 0
LOAD_LAYOUTS = [(2, 2, 1), (4, 1, 1)]  # (tp, pp, vpp)


def _gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    base = dict(vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=LAYERS, n_head=4, resid_pdrop=0,
                embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**base, **kw}))


def _bloom(**kw):
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(**{**dict(vocab_size=VOCAB, hidden_size=48, n_layer=LAYERS,
                                                  n_head=4, bos_token_id=0, eos_token_id=0), **kw}))


_LLAMA_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=LAYERS,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**{**_LLAMA_BASE, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**{**_LLAMA_BASE, **kw}))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**{**_LLAMA_BASE, **kw}))


SUPPORTED = {  # name: (builder, non-default fields)
    "gpt2-untied": (_gpt2, dict(tie_word_embeddings=False)),
    "gpt2-inverse-layer-idx": (_gpt2, dict(scale_attn_by_inverse_layer_idx=True)),
    "gpt2-unscaled": (_gpt2, dict(scale_attn_weights=False)),
    "gpt2-gelu-n-inner": (_gpt2, dict(activation_function="gelu", n_inner=72)),
    "bloom-untied": (_bloom, dict(tie_word_embeddings=False)),
    "llama-head-dim-24": (_llama, dict(head_dim=24)),
    "qwen2-gqa-tied": (_qwen2, dict(tie_word_embeddings=True)),
    "qwen2-mqa-untied": (_qwen2, dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen3-gqa-tied-head-dim-24": (_qwen3, dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-mha-untied": (_qwen3, dict(num_key_value_heads=8, head_dim=8,
                                      tie_word_embeddings=False)),
    "qwen2-sliding-window": (_qwen2, dict(use_sliding_window=True, sliding_window=3,
                                          max_window_layers=1)),
    "qwen3-partial-rotary": (_qwen3, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e3,
                                                           "partial_rotary_factor": 0.5})),
}
REFUSED = {  # name: (builder, fields, the field the error must name)
    "gpt2-cross-attention": (_gpt2, dict(add_cross_attention=True), "add_cross_attention"),
    "gpt2-relu": (_gpt2, dict(activation_function="relu"), "activation_function"),
    "gpt2-dropouts": (_gpt2, dict(embd_pdrop=0.2), "embd_pdrop"),
    "gpt2-unknown-field": (_gpt2, dict(use_fancy_attention=True), "use_fancy_attention"),
    "bloom-post-ln-residual": (_bloom, dict(apply_residual_connection_post_layernorm=True),
                               "apply_residual_connection_post_layernorm"),
    "llama-gelu": (_llama, dict(hidden_act="gelu"), "hidden_act"),
    "llama-mlp-bias-only": (_llama, dict(mlp_bias=True), "mlp_bias"),
    "llama-pruned-heads": (_llama, dict(pruned_heads={0: [1]}), "pruned_heads"),
    "qwen2-chunked-layer": (_qwen2, dict(layer_types=["chunked_attention"] * LAYERS), "layer_types"),
    "qwen3-attention-bias": (_qwen3, dict(attention_bias=True), "attention_bias"),
    "qwen3-yarn-partial-rotary": (_qwen3, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e3, "factor": 2.0,
        "original_max_position_embeddings": 8, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unmodelled_fields_are_refused_naming_the_field(name, tmp_path):
    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.training.checkpoint.hf import ConversionError, import_hf
    build, fields, field = REFUSED[name]
    hf = build(**fields)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises((ConversionError, UnsupportedConfigError), match=rf"^[^\n]*{field}=[^\n]*$"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "mz"))
    assert not (tmp_path / "mz").exists()  # refused before any work


def test_real_config_files_with_training_leftovers_are_accepted():
    """Fields that transformers ignores for a family (as in released config.json files) pass."""
    from transformers import BloomConfig, GPT2Config, LlamaConfig

    from megazoo.models.bloom import adapter as bloom
    from megazoo.models.gpt2 import adapter as gpt
    from megazoo.models.llama import adapter as llama
    gpt.config_from_hf(GPT2Config(n_ctx=1024, summary_type="cls_index", reorder_and_upcast_attn=True,
                                  task_specific_params={"text-generation": {"do_sample": True}}))
    bloom.config_from_hf(BloomConfig(offset_alibi=100, skip_bias_add=True, pretraining_tp=4,
                                     attention_softmax_in_fp32=True, masked_softmax_fusion=True))
    llama.config_from_hf(LlamaConfig(is_llama_config=True, rope_interleaved=False, pretraining_tp=2))


def test_released_config_files_are_accepted(tmp_path):
    """config.json files of released checkpoints, every supported family
    (tests/fixtures/released_hf_configs.json, sources in tests/fixtures/README.md) import without a
    refusal and give the parameter count transformers' own class has; those marked `refused` are
    refused in one line naming that field."""
    import json
    import os

    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.training.checkpoint.hf import ConversionError, read_hf_config
    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "released_hf_configs.json")
    for name, entry in json.load(open(fixture)).items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(entry["config"]))
        if "refused" not in entry:
            _, module, hf = read_hf_config(str(tmp_path / name))
            assert module.config_from_hf(hf).num_parameters() == entry["parameters"], name
            continue
        with pytest.raises((ConversionError, UnsupportedConfigError),
                           match=rf"^[^\n]*{entry['refused']}[^\n]*$"):
            _, module, hf = read_hf_config(str(tmp_path / name))
            module.config_from_hf(hf)


def _worker(rank, cases):
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import full_tensor, load_full_state_dict
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from tests.hf_models import check_against_hf
    torch.use_deterministic_algorithms(True)
    errors, checked = [0.0], []
    for tp, pp, vpp in LOAD_LAYOUTS:  # one topology per layout: creating groups is slow
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
        for case in cases:
            errors.append(check_against_hf(case, topo, NEW_TOKENS)[1])
            checked.append((case["name"], tp, pp))
    # Qwen3's q/k norm weights are replicated but see other heads on each TP rank: their
    # gradients (summed over TP) equal the unsharded model's, with and without SP.
    case = next(c for c in cases if c["name"].startswith("qwen3-gqa"))
    ids, labels = case["ids"][:, :-1], case["ids"][:, 1:]
    grads = {}
    for tp, sp in ((1, False), (2, False), (4, True)):
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, sequence_parallel=sp))
        model = build_model(case["config"], topo)
        load_full_state_dict(model, case["full"], topo)
        model(ids, labels=labels).mean().backward()
        grads[tp] = {n: full_tensor(p, topo, p.grad) for n, p in model.named_parameters()}
    for tp in (2, 4):
        for n, g in grads[1].items():
            torch.testing.assert_close(grads[tp][n], g, rtol=1e-5, atol=1e-6, msg=f"tp{tp} {n}")
    assert any("q_norm" in n for n in grads[1])
    return max(errors), checked


def test_fields_and_qwen_round_trip_and_match_transformers_under_tp_pp(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    cases, _ = round_trip_cases(SUPPORTED, tmp_path, ids, ids[:, :5])
    errors_and_checked = run_distributed(_worker, 4, cases, timeout=500)
    print("max |logits - transformers| over ranks:", max(e for e, _ in errors_and_checked))
    assert max(e for e, _ in errors_and_checked) <= 1e-5
    assert len(errors_and_checked[0][1]) == len(SUPPORTED) * len(LOAD_LAYOUTS)


def test_import_layout_errors_name_the_flag_and_field(tmp_path, capsys):
    from tests.tool_runs import convert_hf_tool
    _llama(hidden_size=36, num_attention_heads=9, num_key_value_heads=9, head_dim=4,
           intermediate_size=1536, num_hidden_layers=2).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    for flags, expected in (
            (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be an integer >= 1"),
            (["--tensor-model-parallel-size", "9"], "--ffn-hidden-size 1536 (HF intermediate_size)"),
            (["--virtual-pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1")):
        assert convert_hf_tool("import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "mz"),
                               *flags) == 1
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "mz").exists()


# Released configs shrunk: sizes reduced, every structural field as released (rope scaling, tied
# embeddings, biases, head_dim against hidden/heads, windows, MoE layout, layer patterns).
_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # None: left out
SHRUNK = {  # fixture entry: overrides
    "llama3.1-70b": dict(_SMALL, num_attention_heads=8, num_key_value_heads=2),
    "llama3.3-70b-instruct": dict(_SMALL, num_attention_heads=8, num_key_value_heads=1),
    "llama3.2-1b-instruct": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16),
    "mistral-7b-v0.1": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=5),
    "mistral-7b-v0.3": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2),
    "mistral-nemo-base-2407": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=24),
    "gemma-3-1b-it": dict(_SMALL, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=16, sliding_window=5),
    "qwen1.5-moe-a2.7b-chat": dict(_SMALL, num_attention_heads=4, num_key_value_heads=4,
                                   num_experts=8, num_experts_per_tok=4,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen2.5-1.5b": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2),
    "qwen3-8b": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mixtral-8x7b": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4),
    "qwen2-57b-a14b": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                           num_experts_per_tok=4, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48),
    "qwen3-30b-a3b": dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32),
    "qwen3-next-80b-a3b-thinking": dict(
        _SMALL, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16),
    "deepseek-v3": dict(
        _SMALL, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0,
        quantization_config=None),
    "gpt-oss-20b": dict(
        _SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, experts_per_token=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], quantization_config=None),
    "nemotron-h-56b-base-8k": dict(
        _SMALL, num_hidden_layers=5, hybrid_override_pattern="M-M*-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_head_dim=16, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8),
    "nemotron-3-nano-30b-a3b": dict(
        _SMALL, num_hidden_layers=5, hybrid_override_pattern="MEM*E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=16, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48),
    # a multimodal release: its text_config shrunk (no dense MLP: no intermediate_size), the
    # released head_dim, partial rotary and mrope sections, attention every 4th layer, kept
    "qwen3.5-35b-a3b": dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, eos_token_id=None,
        layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


def _shrunk(config: dict, overrides: dict) -> dict:
    """A released config.json with `overrides` (a multimodal release's in its text_config);
    an override None leaves the field out."""
    if "text_config" in config:
        return dict(config, text_config=_shrunk(config["text_config"], overrides))
    return {k: v for k, v in {**config, **overrides}.items() if v is not None}


def test_shrunk_released_configs_match_transformers(tmp_path):
    """Each released structure above, shrunk, read as megazoo reads a checkpoint folder: the
    parameter count of transformers' own model, and fp32 logits within 1e-5 of it on the same
    (perturbed random) weights."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    from megazoo.training.checkpoint.hf import read_hf_config
    from tests.hf_models import hf_converted
    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "released_hf_configs.json")
    released = json.load(open(fixture))
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    errors = {}
    for i, (name, overrides) in enumerate(sorted(SHRUNK.items())):
        config = _shrunk(released[name]["config"], overrides)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        _, module, hf_config = read_hf_config(str(tmp_path / name))
        hf_config._attn_implementation = "eager"
        torch.manual_seed(i)
        hf = perturbed(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32), seed=i)
        cfg, model = hf_converted(hf, module)
        assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters()), name
        with torch.no_grad():
            want, got = hf(ids).logits, model(ids)[..., :96]
        errors[name] = (got - want).abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    print("max |logits - transformers|:", errors)
    assert len(errors) == len(SHRUNK)


def test_release_fields_other_than_what_transformers_computes_are_refused():
    """Fields released config.json files carry for their authors' own code, which transformers
    does not read (it always computes one value): accepted at that value (the released files
    above), refused in one line at any other."""
    from transformers import (DeepseekV3Config, GptOssConfig, NemotronHConfig, Qwen3_5TextConfig,
                              Qwen3MoeConfig)

    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.models.registry import family
    cases = [("qwen3_moe", Qwen3MoeConfig(use_qk_norm=False), "use_qk_norm"),
             ("qwen3_moe", Qwen3MoeConfig(shared_expert_intermediate_size=64),
              "shared_expert_intermediate_size"),
             ("deepseek_v3", DeepseekV3Config(scoring_func="softmax"), "scoring_func"),
             ("deepseek_v3", DeepseekV3Config(moe_layer_freq=2), "moe_layer_freq"),
             ("nemotron_h", NemotronHConfig(attention_head_dim=64), "attention_head_dim"),
             ("gpt_oss", GptOssConfig(experts_per_token=3), "experts_per_token"),
             ("qwen3_5_text", Qwen3_5TextConfig(attn_output_gate=False), "attn_output_gate")]
    for name, hf, field in cases:
        with pytest.raises(UnsupportedConfigError, match=rf"^[^\n]*{field}=[^\n]*$"):
            family(name).adapter.config_from_hf(hf)
