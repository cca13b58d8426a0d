"""DeepSeek-V3 multi-token prediction (models/multi_token_prediction.py).

* The unsharded model's per-depth MTP losses, the loss that trains (main + factor / D x the sum)
  and every gradient equal a reference assembled from transformers' DeepSeek-V3 modules (the HF
  model's embedding, final norm and lm_head, DeepseekV3DecoderLayer, DeepseekV3RMSNorm and an
  nn.Linear per depth) on the same weights, with two depths (an MoE layer each), fp32 1e-5; the
  reported loss is the main one; a loss mask masks the depths' shifted targets alike; the
  depths' MoE layers join the expert-bias update; eval forwards skip the depths.
* HF folder in the released layout (`model.layers.{N + k}.*` with the depths' embedding and head
  copies) -> megazoo checkpoint at tp2 x pp2 (the offline reshard) -> HF folder: bit-identical,
  tp1 again too; transformers' AutoModelForCausalLM loads the folder (skipping the depths) with
  logits equal ours; a depth copy that differs from the main embedding is refused.
* Greedy generation with the depths present equals the model without them (they never run).
* The flags: --mtp-num-layers / --mtp-loss-scaling-factor reach the config; other families and
  per-token losses are refused in one line.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megazoo.models.deepseek_v3 import adapter as deepseek_v3
from megazoo.models.deepseek_v3.model import DeepseekV3Model
from megazoo.models.moe import update_expert_biases
from megazoo.models.multi_token_prediction import shifted
from megazoo.parallel.sharding import load_full_state_dict
from megazoo.parallel.topology import ParallelTopology
from tests.helpers import one_thread  # noqa: F401 - autouse

TOL = dict(rtol=1e-5, atol=1e-5)
N, D, VOCAB = 2, 2, 96  # main layers (1 dense, 1 MoE), prediction depths (MoE layers), vocabulary


def _hf_config(**kw):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=48, moe_intermediate_size=12,
        num_hidden_layers=N, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=10,
        qk_rope_head_dim=4, v_head_dim=5, qk_nope_head_dim=6, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        num_nextn_predict_layers=D, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None), **kw})


def _perturb(module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in name:
                scale = 0.3 if name.endswith("e_score_correction_bias") or t.dim() == 1 else 0.05
                t.add_(torch.randn(t.shape, generator=g) * scale)


class _HFDepths(torch.nn.Module):
    """The prediction depths as the released checkpoints lay them out, from transformers'
    DeepSeek-V3 modules: enorm, hnorm, eh_proj, one decoder layer, shared_head.norm."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                          DeepseekV3RMSNorm)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layers = torch.nn.ModuleDict()
        for k in range(D):
            depth = torch.nn.Module()
            depth.enorm, depth.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
            depth.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            depth.layer = DeepseekV3DecoderLayer(config, N + k)
            depth.shared_head = torch.nn.Module()
            depth.shared_head.norm = DeepseekV3RMSNorm(h, eps)
            self.layers[str(N + k)] = depth

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """model.layers.{N + k}.* as in the released files (the decoder layer's tensors flat)."""
        return {f"model.layers.{name.replace('.layer.', '.', 1)}": t
                for name, t in self.layers.state_dict().items()}


def _hf_models(seed: int = 0):
    from transformers import DeepseekV3ForCausalLM
    config = _hf_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf, depths = DeepseekV3ForCausalLM(config).eval(), _HFDepths(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # bare modules (no PreTrainedModel init): experts start as torch.empty
        for name, t in list(depths.named_parameters()) + list(depths.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.zero_()
            elif t.dim() == 1:
                t.fill_(1.0)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    _perturb(hf, g)
    _perturb(depths, g)
    return hf, depths


def _reference_losses(hf, depths, ids, labels, mask=None):
    """(main mean loss, [each depth's mean loss over the positions whose target `mask` counts])
    computed from the HF modules."""
    mask = torch.ones(labels.shape) if mask is None else mask
    s = ids.shape[1]
    positions = torch.arange(s)[None].expand(ids.shape[0], -1)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    hidden = hf.model(ids).last_hidden_state  # after the final norm
    main = F.cross_entropy(hf.lm_head(hidden).flatten(0, 1), labels.flatten())
    out = []
    for k in range(1, D + 1):
        depth = depths.layers[str(N + k - 1)]
        tokens = torch.zeros_like(ids)  # t_{i+k}, 0 where the sequence has none
        tokens[:, :s - k] = ids[:, k:]
        x = depth.eh_proj(torch.cat([depth.enorm(hf.model.embed_tokens(tokens)),
                                     depth.hnorm(hidden)], -1))
        rope = hf.model.rotary_emb(x, positions)
        hidden = depth.shared_head.norm(depth.layer(x, attention_mask=causal, position_ids=positions,
                                                    position_embeddings=rope))
        logits = hf.lm_head(hidden)[:, :s - k]
        ce = F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten(), reduction="none")
        out.append((ce * mask[:, k:].flatten()).sum() / mask[:, k:].sum())
    return main, out


def _ours(hf, depths, topo=None):
    topo = topo or ParallelTopology.single()
    cfg = deepseek_v3.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    model = DeepseekV3Model(cfg, topo)
    sd = {**hf.state_dict(), **depths.file_tensors()}
    load_full_state_dict(model, deepseek_v3.from_hf_state_dict(sd, cfg), topo)
    return cfg, model, sd


def _batch():
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_mtp_loss_and_gradients_equal_a_reference_from_transformers_modules():
    hf, depths = _hf_models()
    cfg, model, sd = _ours(hf, depths)
    assert cfg.mtp_num_layers == D and [cfg.is_moe_layer(N + k) for k in range(D)] == [True, True]
    ids, labels = _batch()
    model.train()  # no dropout in this config; training mode records the depths' losses
    main, theirs = _reference_losses(hf, depths, ids, labels)
    want = main + cfg.mtp_loss_scaling_factor / D * torch.stack(theirs).sum()
    want.backward()
    per_token = model(ids, labels=labels)
    torch.testing.assert_close(per_token.mean(), main, **TOL)  # the reported loss: the main one
    per_depth = model.mtp.stats.totals[1:].float()
    torch.testing.assert_close(per_depth, torch.stack(theirs).detach(), **TOL)
    assert model.mtp.stats.totals[0] == 1
    per_token.mean().backward()  # the depths' loss rides along with gradient 1 (one microbatch)
    ref_grads = {k: torch.zeros_like(v) for k, v in sd.items()}
    named = dict(hf.named_parameters())
    for n, p in depths.layers.named_parameters():
        named["model.layers." + n.replace(".layer.", ".", 1)] = p
    ref_grads.update({name: p.grad for name, p in named.items()})
    want_grads = deepseek_v3.from_hf_state_dict(ref_grads, cfg)
    checked = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want_grads[model.canonical_name(name)], **TOL,
                                       msg=name)
            checked += 1
    assert checked > 40 and model.mtp.depths[1].eh_proj.weight.grad.abs().sum() > 0
    # the depths' MoE layers count their load for the expert-bias update too
    update_expert_biases([model], cfg.num_layers, torch.device("cpu"))
    assert all(d.layer.mlp.expert_bias.abs().sum() > 0 for d in model.mtp.depths)
    # a loss mask (--eod-mask-loss) masks each depth's shifted targets alike
    mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(8)) > 0.3).float()
    model.mtp.stats.reset()
    with torch.no_grad():
        model(ids, labels=labels, loss_mask=mask)
        _, masked = _reference_losses(hf, depths, ids, labels, mask)
    torch.testing.assert_close(model.mtp.stats.totals[1:].float(), torch.stack(masked), **TOL)
    assert not torch.allclose(torch.stack(masked), torch.stack(theirs).detach())
    # evaluation (no graph) skips the depths: same main loss, nothing recorded
    model.eval()
    model.mtp.stats.reset()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels=labels).mean(), main, **TOL)
    assert model.mtp.stats.totals[0] == 0


def test_shift_moves_left_and_zero_fills():
    t = torch.arange(1, 6)[None]
    assert shifted(t, 0).tolist() == [[1, 2, 3, 4, 5]]
    assert shifted(t, 2).tolist() == [[3, 4, 5, 0, 0]]
    assert shifted(t, 7).tolist() == [[0, 0, 0, 0, 0]]


def _write_folder(folder, hf, tensors) -> None:
    from safetensors.torch import save_file
    folder.mkdir()
    hf.config.save_pretrained(folder)
    save_file({k: v.clone() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _folder_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def test_hf_folder_round_trip_carries_the_depths_through_tp2_pp2_and_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM
    from megazoo.training.checkpoint.hf import ConversionError, export_hf, import_hf
    hf, depths = _hf_models(seed=4)
    cfg, model, _ = _ours(hf, depths)
    files = deepseek_v3.to_hf_state_dict({k: v for k, v in deepseek_v3.from_hf_state_dict(
        {**hf.state_dict(), **depths.file_tensors()}, cfg).items()}, cfg)
    for k in range(D):  # the released layout: each depth holds copies of the embedding and head
        assert torch.equal(files[f"model.layers.{N + k}.embed_tokens.weight"],
                           hf.model.embed_tokens.weight)
        assert torch.equal(files[f"model.layers.{N + k}.shared_head.head.weight"], hf.lm_head.weight)
        assert f"model.layers.{N + k}.mlp.experts.7.down_proj.weight" in files
    _write_folder(tmp_path / "hf", hf, files)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "sharded"), tp=2, pp=2)
    export_hf(str(tmp_path / "sharded"), str(tmp_path / "out"))
    import_hf(str(tmp_path / "out"), str(tmp_path / "whole"))
    export_hf(str(tmp_path / "whole"), str(tmp_path / "again"))
    for out in ("out", "again"):
        back = _folder_tensors(tmp_path / out)
        assert sorted(back) == sorted(files), out
        for k, v in files.items():
            assert torch.equal(back[k], v), (out, k)
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["num_nextn_predict_layers"] == D
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids)[..., :VOCAB], loaded(ids).logits, **TOL)
    # a depth whose embedding copy differs from the main one: refused in one line
    files[f"model.layers.{N}.embed_tokens.weight"] = files["model.embed_tokens.weight"] + 1
    _write_folder(tmp_path / "bad", hf, files)
    with pytest.raises((ValueError, ConversionError), match="embed_tokens.weight differs") as e:
        import_hf(str(tmp_path / "bad"), str(tmp_path / "bad_ckpt"))
    assert "\n" not in str(e.value)


def test_generation_is_unchanged_by_the_depths():
    from megazoo.models.generation import SamplingConfig, generate
    hf, depths = _hf_models(seed=7)
    cfg, model, sd = _ours(hf, depths)
    plain_cfg = cfg.replace(mtp_num_layers=0)
    topo = ParallelTopology.single()
    plain = DeepseekV3Model(plain_cfg, topo)
    load_full_state_dict(plain, deepseek_v3.from_hf_state_dict(hf.state_dict(), plain_cfg), topo)
    prompt = _batch()[0][:, :4]
    ours = generate(model.eval(), topo, prompt, 6, SamplingConfig())
    assert ours.shape == (2, 10) and torch.equal(ours, generate(plain.eval(), topo, prompt, 6))


def test_mtp_flags_reach_the_config_and_the_rest_is_refused_in_one_line():
    from megazoo.models.presets import preset
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.parser import build_parser
    from megazoo.training.config.flags import to_run_config
    from tests.helpers import TINY
    from megazoo.models.language_model import TransformerLanguageModel
    assert preset("deepseek-v3").mtp_num_layers == 1
    tiny = preset("deepseek-v3-tiny", vocab_size=1024, mtp_num_layers=2, make_vocab_size_divisible_by=1)
    model = TransformerLanguageModel(tiny, ParallelTopology.single())  # the depths counted apart
    built = {n: p.numel() for n, p in model.named_parameters() if not n.endswith("expert_bias")}
    assert sum(v for n, v in built.items() if n.startswith("mtp.")) == tiny.mtp_parameters()
    assert sum(built.values()) == tiny.num_parameters() + tiny.mtp_parameters()
    from megazoo.models.config import TransformerConfig
    plain = TransformerConfig(vocab_size=64, hidden_size=16, num_layers=1, num_attention_heads=2,
                              mtp_num_layers=1)  # learned positions: no family takes it
    assert plain.family is None
    with pytest.raises(ValueError, match="--mtp-num-layers is modelled with rotary or ALiBi"):
        TransformerLanguageModel(plain, ParallelTopology.single())
    parse_args = build_parser().parse_args
    base = ["--model", "deepseek-v3-tiny", *TINY, "--train-iters", "2"]
    run = to_run_config(parse_args(base + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor",
                                           "0.3"]), vocab_size=128, world_size=1)
    assert (run.model.mtp_num_layers, run.model.mtp_loss_scaling_factor) == (2, 0.3)
    with pytest.raises(ArgumentError, match="--calculate-per-token-loss") as e:
        to_run_config(parse_args(base + ["--mtp-num-layers", "1", "--calculate-per-token-loss"]),
                      vocab_size=128, world_size=1)
    assert "\n" not in str(e.value)
    with pytest.raises((ArgumentError, ValueError), match="mtp_num_layers"):
        to_run_config(parse_args(["--model", "qwen3-tiny", *TINY, "--train-iters", "2", "--mtp-num-layers", "1"]),
                      vocab_size=128, world_size=1)
