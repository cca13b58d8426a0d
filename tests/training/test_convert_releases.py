"""Released folder forms read through a supported family (training/checkpoint/hf_releases.py),
each against transformers' own model of the folder, fp32, logits within 1e-5:

* a multimodal Gemma 3 (`Gemma3ForConditionalGeneration`, random, tiny vision tower; files in
  the `language_model.model.*` layout transformers writes) imports its language model, the
  vision tensors left out in one logged line; the export is a `Gemma3ForCausalLM` folder that
  transformers loads with the same logits;
* a multimodal Qwen3.5 in its release layout (`model.language_model.*`, `model.visual.*`, and an
  `mtp.*` head transformers does not load) imports its language model likewise;
* a Kimi K2 folder (a DeepSeek-V3 saved by transformers, config.json as Moonshot ships it:
  model_type kimi_k2, auto_map to its own code, its aux-loss fields) imports as DeepSeek-V3,
  nothing of the release run;
* a gpt-oss folder with its experts in MXFP4 as released (`*_blocks` / `*_scales`, random codes
  and scales; training/checkpoint/hf_mxfp4.py) imports to the model transformers' own MXFP4
  loader dequantizes (logits equal); a missing half of a pair is refused in one line.
"""
from __future__ import annotations

import json
import logging

import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import hf_deepseek_v3, perturbed

VOCAB = 96
IDS = torch.randint(0, 90, (2, 17), generator=torch.Generator().manual_seed(1))
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)


def _imported_logits(folder):
    """The folder through megazoo's import (full tensors) and the unsharded model's logits."""
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import load_full_state_dict
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.training.checkpoint.hf import hf_to_full
    model_type, config, full = hf_to_full(str(folder))
    topo = ParallelTopology.single()
    model = build_model(config.replace(make_vocab_size_divisible_by=8), topo).eval()
    load_full_state_dict(model, full.weights, topo)
    with torch.no_grad():
        return model_type, model(IDS)[..., :VOCAB]


def _logits(hf):
    with torch.no_grad():
        return hf(input_ids=IDS).logits


def test_multimodal_gemma3_imports_its_language_model_and_exports_it(tmp_path, caplog):
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    from megazoo.training.checkpoint.hf import export_hf, import_hf
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=5,
                query_pre_attn_scalar=16, rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    torch.manual_seed(0)
    hf = perturbed(Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=VISION, mm_tokens_per_image=4, image_token_index=95,
        boi_token_index=93, eoi_token_index=94)))
    hf.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gemma3"
    want = _logits(hf)
    with caplog.at_level(logging.WARNING):
        model_type, got = _imported_logits(tmp_path / "hf")
    assert model_type == "gemma3_text"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    left = [r.getMessage() for r in caplog.records if "multimodal" in r.getMessage()]
    assert len(left) == 1 and "vision_tower" in left[0], left
    import_hf(str(tmp_path / "hf"), str(tmp_path / "mz"))
    export_hf(str(tmp_path / "mz"), str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(_logits(back), want, rtol=0, atol=1e-5)


def test_multimodal_qwen3_5_release_imports_its_language_model(tmp_path, caplog):
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, full_attention_interval=4)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=1)
    torch.manual_seed(1)
    hf = perturbed(Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=95, video_token_id=94,
        vision_start_token_id=93, vision_end_token_id=92, tie_word_embeddings=False)), seed=1)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(attn_output_gate=True, mlp_only_layers=[],  # as released
                                 mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config))
    # the release layout, with the multi-token-prediction head transformers does not load
    sd = {k if k.startswith("model.") or k.startswith("lm_head") else "model." + k: v.contiguous()
          for k, v in hf.state_dict().items()}
    sd["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(sd, str(folder / "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in sd)
    with caplog.at_level(logging.WARNING):
        model_type, got = _imported_logits(folder)
    assert model_type == "qwen3_5_text"
    torch.testing.assert_close(got, _logits(hf), rtol=0, atol=1e-5)
    left = [r.getMessage() for r in caplog.records if "multimodal" in r.getMessage()]
    assert len(left) == 1 and "visual" in left[0] and "mtp" in left[0], left


def test_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    hf = hf_deepseek_v3(seed=2)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(model_type="kimi_k2", aux_loss_alpha=0.001, seq_aux=True, auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    path.write_text(json.dumps(config))
    model_type, got = _imported_logits(tmp_path / "hf")
    assert model_type == "deepseek_v3"
    torch.testing.assert_close(got, _logits(hf), rtol=0, atol=1e-5)


def test_mxfp4_gpt_oss_release_imports_as_transformers_dequantizes_it(tmp_path):
    import pytest
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config

    from megazoo.training.checkpoint.hf import ConversionError
    torch.manual_seed(3)
    hf = perturbed(GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)))
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    sd, g = load_file(str(folder / "model.safetensors")), torch.Generator().manual_seed(4)
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = sd.pop(name).shape  # in memory [experts, in, out]
        sd[name + "_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16),
                                             generator=g, dtype=torch.uint8)
        sd[name + "_scales"] = torch.randint(120, 126, (experts, rows, columns // 32),
                                             generator=g, dtype=torch.uint8)
    save_file(sd, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True))
    model_type, got = _imported_logits(folder)
    assert model_type == "gpt_oss"
    torch.testing.assert_close(got, _logits(ref.eval()), rtol=0, atol=1e-5)
    del sd["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"^[^\n]*down_proj_scales is missing[^\n]*$"):
        _imported_logits(folder)
