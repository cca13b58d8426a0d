"""DeepSeek-V3 (models/moe.py, models/mla.py, models/deepseek_v3/) against transformers and hand
references.

* Sigmoid scores, the expert bias for the choice only, group-limited routing (a group scores as
  its two best experts), renormalised top-k and the routed scaling factor, with a shared expert:
  output and every gradient equal `transformers.models.deepseek_v3`'s MoE block (fp32, 1e-5) on
  random weights and a perturbed bias, on tokens that route to every group and whose choice the
  group limit and the bias both change.
* The sequence-wise auxiliary loss equals the DeepSeek-V3 paper's formula written per sequence.
* The aux-loss-free bias update: bias + rate * sign(mean load - load) from the load counted by
  hand over two microbatches, then the load is reset.
* Multi-head latent attention (with and without a query latent, both RoPE layouts): output and
  every gradient equal transformers' DeepseekV3Attention (fp32, 1e-5).
* The deepseek_v3 family: logits, greedy generation and the HF round trip equal transformers';
  unmodelled config fields are refused; the presets count what they build (DeepSeek-V3: 671B).
The model under parallel layouts and in checkpoints: test_models_deepseek_parallel.py.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.init import Initializer
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.models.moe import MoELayer, moe_layers, update_expert_biases
from megazoo.parallel.topology import ParallelTopology
from tests.hf_models import MLA_LATENT, deepseek_config, hf_deepseek_v3

TOL = dict(rtol=1e-5, atol=1e-5)


def _hf_moe(cfg: TransformerConfig, layer: MoELayer):
    """transformers' DeepseekV3MoE with `layer`'s weights (and its expert bias)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    hf = DeepseekV3Config(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                          n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                          n_group=cfg.moe_router_num_groups, topk_group=cfg.moe_router_group_topk,
                          routed_scaling_factor=cfg.moe_router_topk_scaling_factor,
                          norm_topk_prob=cfg.moe_norm_topk_prob, n_shared_experts=1,
                          hidden_act="silu")
    moe = DeepseekV3MoE(hf)
    f = cfg.moe_shared_expert_intermediate_size
    with torch.no_grad():
        moe.gate.weight.copy_(layer.router)
        moe.gate.e_score_correction_bias.copy_(layer.expert_bias)
        moe.experts.gate_up_proj.copy_(layer.experts.weight1)
        moe.experts.down_proj.copy_(layer.experts.weight2)
        fc1 = layer.shared_expert.fc1.weight
        moe.shared_experts.gate_proj.weight.copy_(fc1[:f])
        moe.shared_experts.up_proj.weight.copy_(fc1[f:])
        moe.shared_experts.down_proj.weight.copy_(layer.shared_expert.fc2.weight)
    return moe


def _hf_attention(cfg: TransformerConfig, mla):
    """transformers' DeepseekV3Attention (eager) with `mla`'s weights, and its rotary embedding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)
    hf = DeepseekV3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
                          q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                          qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                          rope_interleave=cfg.rope_interleave, rope_theta=cfg.rope_theta,
                          max_position_embeddings=64, attention_bias=False)
    hf._attn_implementation = "eager"
    att = DeepseekV3Attention(hf, layer_idx=0)
    pairs = [("kv_a_proj_with_mqa.weight", mla.kv_down), ("kv_a_layernorm.weight", mla.kv_norm.weight),
             ("kv_b_proj.weight", mla.kv_up.weight), ("o_proj.weight", mla.dense.weight)]
    if cfg.q_lora_rank:
        pairs += [("q_a_proj.weight", mla.q_down), ("q_a_layernorm.weight", mla.q_norm.weight),
                  ("q_b_proj.weight", mla.q_up.weight)]
    else:
        pairs += [("q_proj.weight", mla.q_proj.weight)]
    params = dict(att.named_parameters())
    assert len(pairs) == len(params)
    with torch.no_grad():
        for name, p in pairs:
            params[name].copy_(p)
    return att, DeepseekV3RotaryEmbedding(hf), {name: p for name, p in pairs}


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=None, rope_interleave=False)])
def test_multi_latent_attention_equals_transformers(kw):
    from megazoo.models.mla import MultiLatentAttention
    cfg = deepseek_config(hidden_size=40, layernorm_epsilon=1e-6, rope_theta=500.0, **{**MLA_LATENT, **kw})
    mla = MultiLatentAttention(cfg, ParallelTopology.single(), Initializer(cfg), "layers.0.attention.",
                               None)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():  # weights large enough for uneven attention; norms not all ones
        for p in mla.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    att, rotary, pairs = _hf_attention(cfg, mla)
    s, b = 9, 2
    x = torch.randn(s, b, 40, generator=g)
    r = torch.randn(s, b, 40, generator=g)
    xs = x.clone().requires_grad_()
    out = mla(xs)
    (out * r).sum().backward()
    xh = x.transpose(0, 1).contiguous().requires_grad_()
    positions = torch.arange(s).unsqueeze(0)
    mask = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
    ref, _ = att(xh, rotary(xh, positions), mask)
    (ref * r.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(out, ref.transpose(0, 1), **TOL)
    torch.testing.assert_close(xs.grad, xh.grad.transpose(0, 1), **TOL)
    hf_params = dict(att.named_parameters())
    for name, p in pairs.items():
        torch.testing.assert_close(p.grad, hf_params[name].grad, **TOL, msg=name)


def _layer(cfg: TransformerConfig) -> MoELayer:
    return MoELayer(cfg, ParallelTopology.single(), Initializer(cfg), "layers.0.mlp.")


def test_deepseek_moe_equals_transformers():
    cfg = deepseek_config()
    layer = _layer(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # larger router weights and a perturbed bias: choices that differ
        layer.router.normal_(0, 0.5, generator=g)
        layer.expert_bias.copy_(torch.randn(8, generator=g) * 0.3)
    hf = _hf_moe(cfg, layer)
    x = torch.randn(16, 4, 32, generator=g)  # [s, b, h]
    r = torch.randn(16, 4, 32, generator=g)
    layer.eval()
    xs = x.clone().requires_grad_()
    out = layer(xs)
    (out * r).sum().backward()
    xh = x.transpose(0, 1).contiguous().requires_grad_()  # HF: [b, s, h]
    ref = hf(xh)
    (ref * r.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(out, ref.transpose(0, 1), **TOL)
    torch.testing.assert_close(xs.grad, xh.grad.transpose(0, 1), **TOL)
    f = cfg.moe_shared_expert_intermediate_size
    hf_grads = {"router": hf.gate.weight.grad, "experts.weight1": hf.experts.gate_up_proj.grad,
                "experts.weight2": hf.experts.down_proj.grad,
                "shared_expert.fc1.weight": torch.cat([hf.shared_experts.gate_proj.weight.grad,
                                                       hf.shared_experts.up_proj.weight.grad]),
                "shared_expert.fc2.weight": hf.shared_experts.down_proj.weight.grad}
    assert f == 12 and hf_grads["router"].abs().sum() > 0
    for name, p in layer.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, hf_grads[name], **TOL, msg=name)
    # the tokens exercise every group, the group limit and the bias
    logits = (x.reshape(-1, 32) @ layer.router.t()).float()
    _, experts = layer.route(logits)
    assert set((experts // 2).unique().tolist()) == {0, 1, 2, 3}
    assert all(len(set(row)) <= 2 for row in (experts // 2).tolist())  # at most topk_group groups
    unlimited = (torch.sigmoid(logits) + layer.expert_bias).topk(3).indices.sort().values
    assert (unlimited != experts.sort().values).any(), "the group limit changes some choice"
    with torch.no_grad():
        bias, layer.expert_bias[:] = layer.expert_bias.clone(), 0.0
        _, plain = layer.route(logits)
        layer.expert_bias.copy_(bias)
    assert (plain.sort().values != experts.sort().values).any(), "the bias changes some choice"


def test_sequence_aux_loss_is_the_papers_per_sequence_formula():
    cfg = deepseek_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1,
                          moe_router_enable_expert_bias=False)
    layer = _layer(cfg)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 32, generator=g)  # [s, b, h]: 3 sequences of 6 tokens
    layer.train()
    layer(x).sum().backward()
    got_aux, got_grad = layer.stats.totals[3].item(), layer.router.grad.clone()
    router = layer.router.detach().clone().requires_grad_()
    layer.router.grad = None
    s, b, e, k = 6, 3, 8, 3
    losses = []
    for i in range(b):  # L = alpha * sum_e f_e P_e per sequence, f_e = E / (K s) * count_e
        logits = (x[:, i] @ router.t()).float()
        scores = torch.sigmoid(logits)
        _, chosen = layer.route(logits.detach())
        f = torch.bincount(chosen.reshape(-1), minlength=e).float() * e / (k * s)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append(0.1 * (f * p).sum())
    ref = torch.stack(losses).mean()
    ref.backward()
    # the layer's output sum adds the routed and shared outputs' router gradient: remove it
    layer.zero_grad()
    cfg0 = deepseek_config(moe_router_enable_expert_bias=False)
    plain = _layer(cfg0)
    plain.train()
    plain(x).sum().backward()
    torch.testing.assert_close(got_aux, ref.item(), **TOL)
    torch.testing.assert_close(got_grad - plain.router.grad, router.grad, **TOL)
    assert ref.item() > 0


def test_expert_bias_update_is_the_sign_rule_on_the_load():
    cfg = deepseek_config(moe_router_bias_update_rate=0.01)
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    layers = moe_layers(model)
    seen = {id(m): [] for m in layers}
    for m in layers:
        m.register_forward_pre_hook(lambda mod, args: seen[id(mod)].append(args[0].detach()))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for m in layers:
            m.expert_bias.copy_(torch.randn(8, generator=g) * 0.1)
    before = [m.expert_bias.clone() for m in layers]
    model.train()
    for _ in range(2):  # two microbatches, one update
        model(torch.randint(0, 96, (2, 8), generator=g)).sum().backward()
    update_expert_biases([model], cfg.num_layers, torch.device("cpu"))
    for m, bias in zip(layers, before):
        load = torch.zeros(8)
        for x in seen[id(m)]:  # the choice by hand: sigmoid + bias, best 2 groups, top 3
            choice = torch.sigmoid((x.reshape(-1, 32) @ m.router.t()).float()) + bias
            groups = choice.view(-1, 4, 2).sum(-1).topk(2).indices  # 2 per group: top-2 = all
            mask = torch.zeros(choice.shape[0], 4, dtype=torch.bool).scatter_(1, groups, True)
            choice = choice.masked_fill(~mask.repeat_interleave(2, dim=1), -1e9)
            load += torch.bincount(choice.topk(3).indices.reshape(-1), minlength=8).float()
        assert load.sum() == 2 * 16 * 3 and (load != load.mean()).all()
        want = bias + 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(m.expert_bias, want, rtol=0, atol=0)
        assert m.expert_load.sum() == 0 and m.expert_bias.grad is None


def test_deepseek_v3_family_logits_generation_and_round_trip():
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    from megazoo.models.deepseek_v3.model import DeepseekV3Model
    from megazoo.models.registry import family
    from megazoo.parallel.sharding import load_full_state_dict
    hf = hf_deepseek_v3()
    cfg = deepseek_v3.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    assert family("deepseek_v3").adapter is deepseek_v3 and cfg.family == "deepseek_v3"
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    topo = ParallelTopology.single()
    model = DeepseekV3Model(cfg, topo).eval()
    sd = {k: v for k, v in hf.state_dict().items()}
    full = deepseek_v3.from_hf_state_dict(sd, cfg)
    load_full_state_dict(model, full, topo)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :96], hf(ids).logits, **TOL)
    # file form (experts apart) back to megazoo and again: bit-identical
    files = deepseek_v3.to_hf_state_dict(full, cfg)
    again = deepseek_v3.from_hf_state_dict(files, cfg)
    assert sorted(again) == sorted(full)
    for k in full:
        assert torch.equal(again[k], full[k]), k
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in files
    assert torch.equal(files["model.layers.2.mlp.gate.e_score_correction_bias"],
                       sd["model.layers.2.mlp.gate.e_score_correction_bias"])
    # greedy generation (a KV cache of the expanded keys and values) equals transformers'
    from megazoo.models.generation import SamplingConfig, generate
    prompt = ids[:, :4]
    ours = generate(model, topo, prompt, 6, SamplingConfig())
    theirs = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    back = deepseek_v3.hf_config(cfg)
    for k in ("n_routed_experts", "n_group", "topk_group", "first_k_dense_replace", "n_shared_experts",
              "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "rope_interleave"):
        assert getattr(back, k) == getattr(hf.config, k), k
    assert deepseek_v3.config_from_hf(back) == deepseek_v3.config_from_hf(hf.config)


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 500.0},
     "rope_parameters"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps"),
    ("attention_bias", True, "attention_bias")])
def test_deepseek_v3_refuses_what_it_does_not_model_in_one_line(field, value, match):
    from transformers import DeepseekV3Config
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    hf = DeepseekV3Config(hidden_size=40, num_attention_heads=4, num_key_value_heads=4,
                          n_routed_experts=8, num_hidden_layers=2, **{field: value})
    with pytest.raises(ValueError, match=match) as e:
        deepseek_v3.config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_presets_count_what_they_build_and_deepseek_v3_is_671b():
    from megazoo.models.presets import preset
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    tiny = preset("deepseek-v3-tiny", vocab_size=1024)
    model = TransformerLanguageModel(tiny.replace(make_vocab_size_divisible_by=1), ParallelTopology.single())
    built = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("expert_bias"))
    assert built == tiny.num_parameters()
    v3 = preset("deepseek-v3")
    assert abs(v3.num_parameters() / 671e9 - 1) < 0.005  # the paper's 671B (MTP's 14B apart)
    assert abs(v3.num_parameters(active=True) / 37e9 - 1) < 0.02  # and 37B activated per token
    from transformers import DeepseekV3ForCausalLM
    with torch.device("meta"):  # transformers' model of the exported config, without MTP
        hf = DeepseekV3ForCausalLM(deepseek_v3.hf_config(v3))
    assert sum(p.numel() for p in hf.parameters()) == v3.num_parameters()
