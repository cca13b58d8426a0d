"""A family is data (models/registry.py, models/family_rules.py), one process, fp32:

every registered family trained 1 step from its preset (tiny) through the training entry's
config and save path, exported with the real export path and loaded by `transformers`
`AutoModelForCausalLM`: every tensor present (no missing or unexpected key) and logits equal to
megazoo's (1e-5). A Mixtral and a Qwen2-MoE folder imported, fine-tuned a step with train_moe's
flags and exported the same way. A checkpoint written before the family was a field (its
top-level family the class that wrote it, "llama" for an MoE run) exports as the MoE family its
config makes. Dense families refuse MoE fields, train_moe refuses a dense model and an export
that would drop a field refuses, each in one line naming it.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megazoo.models.presets import preset
from megazoo.models.language_model import gather_logits
from megazoo.models.registry import FAMILIES
from megazoo.parallel.topology import ParallelTopology

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "48", "--vocab-size", "61", "--seq-length", "16"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
FLAGS = {  # family: its default preset shrunk (heads 4 need key/value groups dividing them)
    "gpt2": ["--model", "gpt2"],
    "bloom": ["--ffn-hidden-size", "128"],  # HF BLOOM fixes 4 x hidden
    "llama": ["--num-query-groups", "2"],
    "qwen2": ["--num-query-groups", "2"],
    "qwen3": ["--num-query-groups", "2", "--kv-channels", "16"],
    "mistral": ["--num-query-groups", "2"],  # its sliding window 8 < the 9 tokens compared
    "mixtral": ["--num-query-groups", "2"] + MOE,
    "qwen2_moe": ["--num-query-groups", "2", "--moe-shared-expert-intermediate-size", "40"] + MOE,
    "qwen3_moe": ["--num-query-groups", "2", "--kv-channels", "16"] + MOE,
    "gemma3_text": ["--num-query-groups", "2", "--kv-channels", "16"],  # window 4 < 9 tokens
    "gemma4_text": ["--num-query-groups", "2", "--kv-channels", "16"],
    "gpt_oss": ["--num-query-groups", "2", "--kv-channels", "16"] + MOE,
    "deepseek_v3": MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                          "--moe-shared-expert-intermediate-size", "24"],
    # hybrid stacks: their presets name each of 4 layers' kind (docs/hybrid.md)
    "qwen3_5_text": ["--num-layers", "4"],
    "qwen3_next": ["--num-layers", "4"],
    "qwen3_5_moe_text": ["--num-layers", "4"],
    "nemotron_h": ["--num-layers", "4"],
}
TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2",
         "--log-interval", "100", "--eval-interval", "1000", "--seed", "3"]
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _no_run_report(monkeypatch):
    """The run report's PNG (seconds of matplotlib per run) is not what these tests check."""
    monkeypatch.setattr("megazoo.training.run.trainer.write_report", lambda run_dir: "(not drawn)")


def _train(family: str, flags: list[str]):
    """A train_*.py run of `family` in this process: its default preset, then the flags."""
    from megazoo.models.registry import build_model, family as entry
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.entry import check_script_family
    from megazoo.training.run.loop import pretrain
    run = to_run_config(build_parser(entry(family).default_preset).parse_args(flags + TRAIN),
                        world_size=1)
    check_script_family(run.model.family, family)
    return pretrain(build_model, run)


def _export_and_compare(ckpt: str, out: str, family: str) -> None:
    """Export with the real path; transformers loads every tensor; logits equal megazoo's."""
    from transformers import AutoModelForCausalLM

    from megazoo.training.checkpoint.format import resolve
    from megazoo.training.checkpoint.hf import export_hf, load_model_chunks
    export_hf(ckpt, out)
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == family
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    topo = ParallelTopology.single()
    config, (model,) = load_model_chunks(resolve(ckpt), topo)
    assert config.family == family
    with torch.no_grad():
        ours = gather_logits(model(IDS), topo, config.vocab_size)
        theirs = hf.eval()(IDS).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every family trained 1 step from its (shrunk) preset and saved: family -> checkpoint."""
    root, out = tmp_path_factory.mktemp("families"), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("megazoo.training.run.trainer.write_report", lambda run_dir: "(not drawn)")
        for family, flags in FLAGS.items():
            out[family] = str(root / family)
            _train(family, SHAPE + flags + ["--train-iters", "1", "--save", out[family]])
    return out


def test_every_family_trains_saves_and_exports_complete(trained, tmp_path):
    assert sorted(FLAGS) == sorted(FAMILIES)  # a new family gets a case here
    for family, ckpt in trained.items():
        meta = json.load(open(os.path.join(ckpt, "iter_0000001", "meta.json")))
        assert meta["model"]["family"] == family and "family" not in meta, family
        _export_and_compare(ckpt, str(tmp_path / family), family)


def _hf_moe(family: str, folder: str) -> list[str]:
    """A random tiny HF Mixtral / Qwen2-MoE folder and the train_moe flags of the same model."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
    common = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    flags = SHAPE + ["--num-query-groups", "2", "--max-position-embeddings", "64",
                     "--rotary-base", "500", "--untie-embeddings-and-output-weights"] + MOE
    torch.manual_seed(1)
    if family == "mixtral":
        hf = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=24, num_local_experts=4))
        flags = [a if a != "48" else "24" for a in flags]  # Mixtral: one width, the experts'
    else:
        hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
            shared_expert_intermediate_size=40, norm_topk_prob=False, qkv_bias=True))
        flags = ["--model", "qwen2-moe-a2.7b", *flags, "--norm-epsilon", "1e-5",
                 "--moe-shared-expert-intermediate-size", "40"]
    with torch.no_grad():  # HF inits norms to one and biases to zero: make every tensor count
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return flags


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_import_finetune_export(tmp_path, family):
    from megazoo.training.checkpoint.hf import import_hf
    hf_dir, imported, tuned = (str(tmp_path / d) for d in ("hf", "imported", "tuned"))
    flags = _hf_moe(family, hf_dir)
    import_hf(hf_dir, imported)
    result = _train("mixtral", flags + ["--train-iters", "1", "--load", imported, "--finetune",
                                        "--save", tuned])
    assert len(result.losses) == 1
    _export_and_compare(tuned, str(tmp_path / "out"), family)


def test_checkpoint_without_family_field_infers_it(trained, tmp_path):
    ckpt = str(tmp_path / "moe")
    shutil.copytree(trained["mixtral"], ckpt)
    path = os.path.join(ckpt, "iter_0000001", "meta.json")
    meta = json.load(open(path))
    del meta["model"]["family"]
    meta["family"] = "llama"  # what the class-based record said of a train_moe.py model
    json.dump(meta, open(path, "w"))
    _export_and_compare(ckpt, str(tmp_path / "hf"), "mixtral")


def test_families_refuse_what_they_cannot_compute(tmp_path):
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.checkpoint.hf import ConversionError, check_complete
    from megazoo.training.run.entry import check_script_family
    from megazoo.models.presets import PRESETS
    assert sum(len(f.presets) for f in FAMILIES.values()) == len(PRESETS)  # each names one
    assert all(f.default_preset in f.presets for f in FAMILIES.values() if f.default_preset)
    with pytest.raises(ValueError, match="family 'llama' is dense: num_experts=4"):
        preset("smollm2-135m", num_experts=4)
    with pytest.raises(ValueError, match="family 'qwen3' needs qk_layernorm=True, got False"):
        preset("qwen3-tiny", qk_layernorm=False)
    with pytest.raises(ValueError, match="family 'mixtral' is a mixture of experts"):
        preset("moe-tiny", num_experts=None)
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    for extra, family in (([], "mixtral"), (["--qk-layernorm"], "qwen3_moe"),
                          (["--add-qkv-bias"], "qwen2_moe")):  # flags that make another family
        args = build_parser("moe-tiny").parse_args(["--mock-data", "--train-iters", "1", *extra])
        assert to_run_config(args, world_size=1).model.family == family
    with pytest.raises(ArgumentError, match="trains mixture-of-experts families.*'llama'"):
        check_script_family("llama", "mixtral")
    with pytest.raises(ArgumentError, match="train it with train_moe.py"):
        check_script_family("qwen3_moe", "qwen3")
    # a GPT-2 whose rotary settings HF GPT-2 would not record still computes the same; a field
    # that changes the model and that the adapter would lose is refused by name
    gpt = FAMILIES["gpt2"].adapter
    config = preset("gpt2", num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=13)
    hf = gpt.hf_config(config)
    hf.n_positions = 7  # as if the adapter wrote another context length
    with pytest.raises(ConversionError, match="cannot record max_position_embeddings=1024"):
        check_complete(gpt, config, hf, {}, {}, "x")
    from transformers import GPT2LMHeadModel
    hf = gpt.hf_config(config)
    full = gpt.from_hf_state_dict(GPT2LMHeadModel(hf).state_dict(), config)
    check_complete(gpt, config, hf, full, gpt.to_hf_state_dict(full, config), "x")  # complete
    weights = {**full, "layers.0.extra.weight": torch.zeros(1)}  # a tensor GPT-2 has no name for
    with pytest.raises(ConversionError, match="no place for 1 tensor.*layers.0.extra.weight"):
        check_complete(gpt, config, hf, weights, gpt.to_hf_state_dict(full, config), "x")


def test_import_edges_are_modelled_or_refused(tmp_path):
    """BLOOM's slow_but_exact split (transformers then drops two biases) is refused; a tied
    config.json over a different lm_head imports untied, as transformers 5 does; a Llama
    config.json over Qwen2 weights (q/k/v biases) is refused naming the tensors."""
    from transformers import (AutoModelForCausalLM, BloomConfig, LlamaConfig, Qwen2Config,
                              Qwen2ForCausalLM)

    from megazoo.models.bloom import adapter as bloom
    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.training.checkpoint.hf import ConversionError, hf_to_full
    with pytest.raises(UnsupportedConfigError, match="slow_but_exact=True is not supported"):
        bloom.config_from_hf(BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=10,
                                         slow_but_exact=True, pretraining_tp=2))
    shape = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    with torch.no_grad():
        for p in qwen.parameters():
            p.add_(0.02 * torch.randn_like(p))
    untied_head = str(tmp_path / "untied")
    qwen.save_pretrained(untied_head)
    config = json.load(open(os.path.join(untied_head, "config.json")))
    with open(os.path.join(untied_head, "config.json"), "w") as f:
        json.dump({**config, "tie_word_embeddings": True}, f)
    _, cfg, full = hf_to_full(untied_head)
    assert not cfg.tie_word_embeddings
    assert torch.equal(full.weights["head_weight"], qwen.lm_head.weight)
    theirs = AutoModelForCausalLM.from_pretrained(untied_head)  # transformers unties it too
    assert torch.equal(theirs.lm_head.weight, qwen.lm_head.weight)

    llama_config = str(tmp_path / "llama_config")
    qwen.save_pretrained(llama_config)
    LlamaConfig(**shape, tie_word_embeddings=False).save_pretrained(llama_config)
    with pytest.raises(ConversionError, match=r"3 tensor\(s\) config.json has no place for "
                                              r"\(model.layers.0.self_attn.k_proj.bias"):
        hf_to_full(llama_config)
