"""Released checkpoint layouts of the hybrid families, written by transformers itself: Qwen3.5's
vision-language release (config.json of model_type qwen3_5 with a text_config, tensors
model.language_model.* beside model.visual.* and mtp.*) imports into the text model with logits
equal to transformers' own model; Qwen3-Next's per-expert release tensors read as transformers'
conversion reads them; Qwen3.5-MoE's release (qwen3_5_moe) imports and exports through the real
paths; what is not modelled is left out with a logged line or refused in one."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 - autouse

VOCAB = 97
TEXT = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=10,
            linear_conv_kernel_dim=3, rms_norm_eps=1e-5, initializer_range=0.1,
            layer_types=["linear_attention", "full_attention", "linear_attention"])


def _perturb(model, scale=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * scale)


def _load(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def test_qwen35_vision_language_release(tmp_path, caplog):
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from megazoo.models.qwen3_5 import hf as adapter
    from megazoo.models.qwen3_5.model import Qwen35ForCausalLM
    torch.manual_seed(0)
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                       "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                       "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=40,
                  patch_size=2, num_position_embeddings=16)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    hf = hf.float().eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_5" and "text_config" in written
    state = _load(tmp_path)
    assert any(k.startswith("model.language_model.") for k in state)
    assert any(k.startswith("model.visual.") for k in state)
    # the released files also carry the multi-token-prediction head (transformers ignores it)
    state["mtp.fc.weight"] = torch.zeros(40, 80)
    save_file(state, str(tmp_path / "model.safetensors"))

    with caplog.at_level(logging.INFO, logger="megazoo.models.qwen3_5.hf"):
        config = adapter.config_from_hf(AutoConfig.from_pretrained(tmp_path))
        tensors = adapter.from_hf_state_dict(_load(tmp_path), config)
    logged = [r.getMessage() for r in caplog.records]
    assert any("vision config is not modelled" in m for m in logged)
    assert any("leaving out" in m and "model.visual" in m for m in logged)
    ours = Qwen35ForCausalLM(config).eval()
    ours.load_state_dict(tensors)  # strict: every text tensor, nothing else
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the export is the text model's layout (Qwen3_5ForCausalLM), whose names transformers reads
    exported = adapter.to_hf_state_dict(ours.state_dict(), config)
    assert not any(k.startswith(("model.language_model.", "model.visual.", "mtp.")) for k in exported)
    assert all(torch.equal(exported[k], tensors[k]) for k in tensors)

    # refused in one line: another release family, a contradictory top-level tie
    from transformers import Qwen3_5MoeConfig

    from megazoo.models.hf_fields import UnsupportedConfigError
    for release, field in ((Qwen3_5MoeConfig(), "model_type"),
                           (Qwen3_5Config(text_config=text, vision_config=vision,
                                          tie_word_embeddings=True), "tie_word_embeddings")):
        with pytest.raises(UnsupportedConfigError, match=field) as err:
            adapter.config_from_hf(release)
        assert "\n" not in str(err.value)


def test_qwen3_next_per_expert_release(tmp_path, caplog):
    """A folder in the released per-expert layout: transformers' own loader (its conversion
    mapping) and megazoo's import read the same model."""
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from megazoo.models.qwen3_next import hf as adapter
    from megazoo.models.qwen3_next.model import Qwen3NextForCausalLM as Ours
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                          shared_expert_intermediate_size=20, decoder_sparse_step=1,
                          mlp_only_layers=[1],
                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                           "partial_rotary_factor": 0.5})
    ref = Qwen3NextForCausalLM(cfg).float().eval()
    _perturb(ref)
    released = {}
    for name, t in ref.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[:-len(".gate_up_proj")]
            for i, w in enumerate(t):
                gate, up = w.chunk(2)
                released[f"{prefix}.{i}.gate_proj.weight"] = gate.contiguous()
                released[f"{prefix}.{i}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len(".down_proj")]
            for i, w in enumerate(t):
                released[f"{prefix}.{i}.down_proj.weight"] = w.contiguous()
        else:
            released[name] = t.contiguous()
    assert not any(k.endswith("gate_up_proj") for k in released)
    released["mtp.fc.weight"] = torch.zeros(40, 80)
    save_file(released, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(tmp_path)

    theirs = Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = adapter.config_from_hf(theirs.config)
    with caplog.at_level(logging.INFO):
        tensors = adapter.from_hf_state_dict(_load(tmp_path), config)
    assert any("mtp" in r.getMessage() for r in caplog.records)
    ours = Ours(config).eval()
    ours.load_state_dict(tensors)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    # the stacked form imports to the same tensors
    fused = adapter.from_hf_state_dict(ref.state_dict(), config)
    assert fused.keys() == tensors.keys() and all(torch.equal(fused[k], tensors[k]) for k in fused)
    # an incomplete release is refused in one line
    broken = {k: v for k, v in released.items() if ".experts.3.up_proj" not in k}
    with pytest.raises(ValueError, match="experts.3.up_proj.weight is missing") as err:
        adapter.from_hf_state_dict(broken, config)
    assert "\n" not in str(err.value)


def test_qwen35_moe_vision_language_release(tmp_path, caplog):
    """Qwen3.5-MoE's release layout (model_type qwen3_5_moe, each expert's tensors apart as
    transformers writes the files, vision tower and MTP head beside) through the real import:
    logits equal transformers' wrapper; the export is the text model (experts stacked), which
    transformers reloads with the same logits."""
    from safetensors.torch import save_file
    from transformers import (AutoModelForCausalLM, Qwen3_5Config, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    from megazoo.models.hf_fields import UnsupportedConfigError
    from megazoo.models.language_model import gather_logits
    from megazoo.models.registry import family
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.training.checkpoint.format import resolve
    from megazoo.training.checkpoint.hf import export_hf, import_hf, load_model_chunks
    torch.manual_seed(0)
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    text.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                shared_expert_intermediate_size=20, rope_parameters={
                    "rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                    "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=40,
                  patch_size=2, num_position_embeddings=16)
    hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text,
                                                             vision_config=vision)).float().eval()
    _perturb(hf)
    with torch.no_grad():  # a router that prefers some experts
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path / "release")
    state = _load(tmp_path / "release")
    assert "model.language_model.layers.0.mlp.experts.4.up_proj.weight" in state
    assert any(k.startswith("model.visual.") for k in state)
    state["mtp.fc.weight"] = torch.zeros(40, 80)
    save_file(state, str(tmp_path / "release" / "model.safetensors"), metadata={"format": "pt"})

    with caplog.at_level(logging.INFO):
        import_hf(str(tmp_path / "release"), str(tmp_path / "ckpt"))
    assert any("mtp" in r.getMessage() for r in caplog.records)
    topo = ParallelTopology.single()
    config, (model,) = load_model_chunks(resolve(str(tmp_path / "ckpt")), topo)
    assert config.family == "qwen3_5_moe_text" and config.num_experts == 5
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(gather_logits(model.eval()(ids), topo, VOCAB), want,
                                   rtol=1e-5, atol=1e-5)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == \
        "qwen3_5_moe_text"
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32,
                                                      output_loading_info=True)
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)

    # refused in one line: a released layer list or router switch transformers would ignore, no
    # shared expert, the dense release given to the MoE family; the fixed values pass
    adapter = family("qwen3_5_moe_text").adapter
    assert adapter.config_from_hf(Qwen3_5MoeConfig(text_config=dict(
        text, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))) == \
        adapter.config_from_hf(hf.config)
    dense = Qwen3_5Config(text_config=TEXT, vision_config=vision)
    for release, field in ((Qwen3_5MoeConfig(text_config=dict(text, mlp_only_layers=[1])),
                            "mlp_only_layers"),
                           (Qwen3_5MoeConfig(text_config=dict(text, shared_expert_intermediate_size=0)),
                            "shared_expert_intermediate_size"),
                           (Qwen3_5MoeConfig(text_config=dict(text, norm_topk_prob=False)),
                            "norm_topk_prob"),
                           (dense, "model_type")):
        with pytest.raises(UnsupportedConfigError, match=field) as err:
            adapter.config_from_hf(release)
        assert "\n" not in str(err.value)
