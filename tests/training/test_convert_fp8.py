"""FP8 block-scaled releases (training/checkpoint/hf_fp8.py) imported by dequantizing.

The FP8 folders are laid out as DeepSeek-V3's and Qwen3-FP8's releases: config.json with
`quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`, dtype bfloat16; every linear weight of the decoder layers
(DeepSeek's router excepted) float8 e4m3 with its float32 `<name>_scale_inv` grid, the rest
bfloat16. transformers' own quantizer (`Fp8Quantize`) quantizes them; a size that is not a
multiple of 128 (DeepSeek's kv_a_proj_with_mqa, 192 rows here as 576 in the release; q_b_proj's
192 columns) is zero-padded for it and cropped, so its edge blocks are partial as released.

* DeepSeek-V3 (partial edge blocks) and Qwen3 (all blocks whole): the import's logits equal
  transformers' model loaded from the dequantized weights (dequantized by transformers'
  `_dequantize_fp8_weight`, fp32) within 1e-5; for Qwen3 also transformers' model loaded from
  the FP8 folder itself (transformers dequantizes while loading; it derives the block from the
  scale grid, so on DeepSeek's partial edge blocks it mis-scales 192 rows in blocks of 96, and
  refuses the release's 576 rows over 5 row blocks: not a reference there). The import logs the
  dequantization once; export writes plain bfloat16 weights without quantization_config.
* The rule on 3-D (stacked experts) tensors with partial edge blocks equals
  `_dequantize_fp8_weight` bit for bit; another quant_method, a static activation scheme, a scale
  grid that does not fit and an FP8 tensor without its scale are refused in one line.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import hf_deepseek_v3

BLOCK = [128, 128]
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
         "weight_block_size": BLOCK}
TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 96


def _quantizer():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    return Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=BLOCK)))


def _quantize(op, name: str, w: torch.Tensor) -> dict:
    """transformers' block quantization of `w`; sizes not a multiple of the block zero-padded
    for it (zeros change no block's max) and cropped back: partial edge blocks, as released."""
    rows, cols = w.shape[-2:]
    q = op._quantize_one(name, F.pad(w, (0, -cols % BLOCK[1], 0, -rows % BLOCK[0])))
    scale = name + "_scale_inv"
    assert q[name].dtype == torch.float8_e4m3fn and set(q) == {name, scale}
    return {name: q[name][..., :rows, :cols].contiguous(), scale: q[scale]}


def _write_fp8(hf, folder, router: str | None):
    """`hf` saved as an FP8 release: decoder-layer matrices quantized (not `router`), the rest bf16."""
    from safetensors.torch import load_file, save_file
    hf.save_pretrained(folder)
    op, out = _quantizer(), {}
    for k, v in load_file(folder / "model.safetensors").items():
        if k.startswith("model.layers.") and v.dim() == 2 and not (router and k.endswith(router)):
            out.update(_quantize(op, k, v.to(torch.bfloat16)))
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(quantization_config=QUANT, dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    return out


def _write_dequantized(sd: dict, fp8_folder, folder):
    """The same model with transformers' dequantization of every FP8 tensor, as fp32."""
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    folder.mkdir()
    plain = {k: (_dequantize_fp8_weight(v, sd[k + "_scale_inv"], BLOCK, torch.float32)
                 if k + "_scale_inv" in sd else v.float()) for k, v in sd.items()
             if not k.endswith("_scale_inv")}
    save_file(plain, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return plain


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.02))
    return hf.eval()


def _deepseek():  # kv_a_proj_with_mqa 128 + 64 = 192 rows, q_b_proj 192 columns: partial blocks
    return hf_deepseek_v3(hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                          topk_group=1, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=64,
                          qk_nope_head_dim=64, v_head_dim=64)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_fp8_release_imports_dequantized_and_exports_plain(family, tmp_path, caplog):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.training.checkpoint.format import latest_checkpoint
    from megazoo.training.checkpoint.hf import export_hf, import_hf, load_model_chunks
    deepseek = family == "deepseek_v3"
    hf = _deepseek() if deepseek else _qwen3()
    fp8 = _write_fp8(hf, tmp_path / "fp8", "mlp.gate.weight" if deepseek else None)
    scales = {k: v.shape for k, v in fp8.items() if k.endswith("_scale_inv")}
    if deepseek:  # partial edge blocks, as in the release
        assert scales["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (2, 2)
        assert scales["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] == (2, 2)
        assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    plain = _write_dequantized(fp8, tmp_path / "fp8", tmp_path / "plain")
    with caplog.at_level(logging.INFO):
        import_hf(str(tmp_path / "fp8"), str(tmp_path / "ck"))
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(said) == 1 and f"dequantized {len(scales)} FP8" in said[0], said
    _, chunks = load_model_chunks(latest_checkpoint(str(tmp_path / "ck")), ParallelTopology.single())
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = chunks[0](ids)[..., :VOCAB]
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
        torch.testing.assert_close(ours, reference(ids).logits, **TOL)
        if not deepseek:  # transformers dequantizes the FP8 folder itself while loading
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
            torch.testing.assert_close(ours, loaded.eval()(ids).logits, **TOL)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    assert not any(k.endswith("_scale_inv") for k in out)
    for k, v in out.items():
        assert torch.equal(v, plain[k].to(torch.bfloat16)), k


def test_block_rule_equals_transformers_and_bad_folders_are_refused(tmp_path):
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    from megazoo.training.checkpoint.hf import ConversionError, import_hf
    from megazoo.training.checkpoint.hf_fp8 import dequantize, dequantize_tensor
    g = torch.Generator().manual_seed(0)
    experts = torch.randn(3, 200, 300, generator=g) * torch.rand(3, 1, 300, generator=g)
    q = _quantize(_quantizer(), "experts.weight", experts)
    fp8, scale = q["experts.weight"], q["experts.weight_scale_inv"]
    assert scale.shape == (3, 2, 3)
    want = _dequantize_fp8_weight(fp8, scale, BLOCK, torch.float32)
    assert torch.equal(dequantize_tensor(fp8, scale, BLOCK), want)
    assert (want - experts).abs().max() < 0.07 * experts.abs().max()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"needs \(3, 2, 3\)"):
        dequantize_tensor(fp8, scale[:, :1], BLOCK, "experts.weight")
    with pytest.raises(ValueError, match="FP8 without"):
        dequantize({"a": fp8, "b": fp8.clone(), "b_scale_inv": scale}, QUANT, "folder")
    with pytest.raises(ValueError, match="static activation scale"):
        dequantize({"a": fp8, "a_scale_inv": scale, "a.input_scale": scale}, QUANT, "folder")
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    for quant, match in (({**QUANT, "quant_method": "awq"}, "quant_method 'awq' is not supported"),
                         ({**QUANT, "activation_scheme": "static"}, "activation_scheme 'static'"),
                         ({**QUANT, "weight_block_size": [128]}, "weight_block_size")):
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "qwen3", "quantization_config": quant}))
        with pytest.raises(ConversionError, match=match) as e:
            import_hf(str(folder), str(tmp_path / "ck"))
        assert "\n" not in str(e.value) and "config.json" in str(e.value)
