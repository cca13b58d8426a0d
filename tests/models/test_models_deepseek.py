"""DeepSeek-V3 routing (models/moe.py) against transformers' DeepseekV3MoE and hand references.

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
* A model of MLA + DeepSeek MoE layers under (tp2 + SP, ep2, dp2) and (pp2, ep2, dp2) with ZeRO-1: losses, expert
  biases after each update and parameters after 2 AdamW steps equal the unsharded model's (the
  load summed over all ranks).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.config import TransformerConfig
from models.init import Initializer
from models.language_model import TransformerLanguageModel
from models.moe import MoELayer, moe_layers, update_expert_biases
from parallel.pipeline.partition import partition
from parallel.sharding import full_tensor
from parallel.topology import ParallelConfig, ParallelTopology
from parallel.zero import OptimizerConfig, build_optimizer
from tests.distributed import run_distributed
from tests.helpers import hf_deepseek_v3
from tests.tolerances import assert_trained_close

TOL = dict(rtol=1e-5, atol=1e-5)
# 8 experts in 4 groups of 2, each token in its best 2 groups, 3 experts per token
ROUTING = dict(num_experts=8, moe_router_topk=3, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
               moe_router_topk_scaling_factor=2.5, moe_norm_topk_prob=True)


def deepseek_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                moe_ffn_hidden_size=12, moe_shared_expert_intermediate_size=12, seed=5, **ROUTING)
    return TransformerConfig(**{**base, **kw})


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


LATENT = dict(kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


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
    from models.mla import MultiLatentAttention
    cfg = deepseek_config(hidden_size=40, layernorm_epsilon=1e-6, rope_theta=500.0, **{**LATENT, **kw})
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


HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, clip_grad=0.5)
BATCH, SEQ, STEPS = 8, 8, 2


def _parallel_config() -> TransformerConfig:
    return deepseek_config(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                           moe_router_bias_update_rate=0.05, **LATENT)  # MLA attention


def _batch(step: int):
    tokens = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(50 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _biases(model) -> dict[int, torch.Tensor]:
    """Global layer number -> a copy of that MoE layer's expert bias."""
    return {i: layer.mlp.expert_bias.clone() for i, layer in
            ((int(k), v) for k, v in model.layers.items()) if isinstance(layer.mlp, MoELayer)}


def _reference(cfg, dp: int):
    """The unsharded model on the whole batch, one microbatch per DP share (each its own aux
    loss), torch AdamW: (losses, biases per step per layer, trained parameters)."""
    from models.moe import set_aux_loss_scale
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                              "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    set_aux_loss_scale([model], 1.0 / dp)
    losses, biases = [], []
    for step in range(STEPS):
        ids, labels = _batch(step)
        total = 0.0
        for i, y in zip(ids.chunk(dp), labels.chunk(dp)):
            loss = model(i, labels=y).mean()
            (loss / dp).backward()
            total += loss.item() / dp
        torch.nn.utils.clip_grad_norm_([p for _, p in named], HYPER["clip_grad"])
        opt.step()
        opt.zero_grad()
        update_expert_biases([model], cfg.num_layers, torch.device("cpu"))
        losses.append(total)
        biases.append(_biases(model))
    return losses, biases, {n: p.detach().clone() for n, p in named}


def _bias_world(rank, layouts):
    from training.run.step import activation_shape, forward_backward
    cfg = _parallel_config()
    initial = {n: p.detach().clone() for n, p in
               TransformerLanguageModel(cfg, ParallelTopology.single()).named_parameters()}
    out = []
    for kw in layouts:
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        ref_losses, ref_biases, ref_params = _reference(cfg, topo.dp)
        spec, = partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]
        model = TransformerLanguageModel(cfg, topo, **spec.kwargs())
        opt = build_optimizer([model], topo, OptimizerConfig(**HYPER, zero_stage=1))
        shape = activation_shape(topo, SEQ, BATCH // topo.dp, cfg.hidden_size)
        moved = 0
        for step in range(STEPS):
            ids, labels = (t.chunk(topo.dp)[topo.dp_rank] for t in _batch(step))
            loss = forward_backward([model], [{"tokens": ids, "labels": labels}], topo, opt,
                                    schedule="1f1b", shape=shape)
            assert not opt.step().skipped
            opt.zero_grad()
            update_expert_biases([model], cfg.num_layers, topo.device)
            torch.testing.assert_close(loss, ref_losses[step], **TOL, msg=f"{kw} loss {step}")
            for i, bias in _biases(model).items():
                want = ref_biases[step][i]
                torch.testing.assert_close(bias, want, rtol=0, atol=1e-7, msg=f"{kw} bias {i} step {step}")
                moved += int((want != 0).sum())
        dp_full = opt.full_parameters()
        got = {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
               for n, p in model.named_parameters() if p.requires_grad}
        assert_trained_close(got, ref_params, initial, str(kw), HYPER["lr"])
        out.append(moved)
    return out


def test_expert_bias_updates_under_tensor_sequence_pipeline_expert_and_data_parallel_equal_unsharded():
    layouts = [dict(tp=2, ep=2, sequence_parallel=True), dict(pp=2, ep=2)]  # dp 2
    moved = run_distributed(_bias_world, 4, layouts, timeout=600)
    assert all(m > 0 for m in moved[0])  # the biases moved, so the comparison saw updates


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_files_carry_the_expert_bias_at_every_zero_stage(stage):
    from training.checkpoint.resume import rank_tensors
    cfg = deepseek_config()
    topo = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer([model], topo, OptimizerConfig(zero_stage=stage))

    class _NoRng:
        def get_states(self):
            return {}
    tensors = rank_tensors([model], opt, _NoRng(), stage)
    biases = sorted(k for k in tensors if k.endswith("expert_bias"))
    assert biases == ["model.0.layers.0.mlp.expert_bias", "model.0.layers.1.mlp.expert_bias"]
    assert ("model.0.layers.0.mlp.router" in tensors) == (stage < 3)


def test_deepseek_v3_family_logits_generation_and_round_trip():
    from models import deepseek_v3
    from models.registry import family
    from parallel.sharding import load_full_state_dict
    hf = hf_deepseek_v3()
    cfg = deepseek_v3.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    assert family("deepseek_v3").adapter is deepseek_v3 and cfg.family == "deepseek_v3"
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    topo = ParallelTopology.single()
    model = deepseek_v3.DeepseekV3Model(cfg, topo).eval()
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
    from models.generation import SamplingConfig, generate
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
    from models import deepseek_v3
    hf = DeepseekV3Config(hidden_size=40, num_attention_heads=4, num_key_value_heads=4,
                          n_routed_experts=8, num_hidden_layers=2, **{field: value})
    with pytest.raises(ValueError, match=match) as e:
        deepseek_v3.config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_presets_count_what_they_build_and_deepseek_v3_is_671b():
    from models.presets import preset
    from models import deepseek_v3
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


def test_expert_biases_survive_a_change_of_layout_bit_for_bit(tmp_path, caplog):
    """The frozen expert biases travel through the layout-independent table: written at
    (pp2, dp2, ZeRO-3), read back whole and by a rank of another layout whose ZeRO shards need
    only the last element of every tensor, then rewritten at tp2 and loaded into a live unsharded model."""
    import math
    from training.checkpoint import layout_writer, reshard, slices
    cfg = _parallel_config()
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.expert_bias.copy_(torch.randn(cfg.num_experts, generator=g) / 3)
    biases = _biases(model)
    weights = {model.canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    trained = {k: v for k, v in weights.items() if not k.endswith("expert_bias")}
    optim = {"master": trained, "exp_avg": {k: v * 0.5 for k, v in trained.items()}}
    full = reshard.FullState(dict(consumed_samples=0, skipped_steps=0), weights, optim)
    src = layout_writer.write_layout(full, str(tmp_path / "a"), config=cfg, tp=1, pp=2, dp=2,
                               zero_stage=3)
    back = reshard.read_full_state(src)
    for i, bias in biases.items():
        assert torch.equal(back.weights[f"layers.{i}.mlp.expert_bias"], bias)
        assert f"layers.{i}.mlp.expert_bias" not in back.master  # weights only, no state

    topo, chunks = layout_writer.build_rank_chunks(cfg, tp=1, pp=1, vpp=1, dp=2, rank=1)
    rows = reshard.param_table(chunks, frozen=True)
    ranges = [[i, math.prod(r[3]) - 1, math.prod(r[3]), 0] for i, r in enumerate(rows)
              if not reshard.is_frozen(r)]
    part = reshard.read_full_state(src, {r[2] for r in rows}, need=slices.need_of(rows, 0, 1, ranges))
    for i, bias in biases.items():
        assert torch.equal(part.weights[f"layers.{i}.mlp.expert_bias"], bias)
    # the first data-parallel rank's file is opened for the frozen biases alone once nothing
    # else it holds is needed (here the experts, always read whole, are taken out of the record)
    record = dict(reshard.ckpt.read_meta(src)["slices"])
    record["params"] = {k: v for k, v in record["params"].items() if not v[3]}
    need = slices.need_of(rows, 0, 1, ranges)
    assert [slices.file_wanted(record, 0, 0, 0, 1, need, optimizer_shards=True, holds_frozen=h)
            for h in ((True, True), (False, False))] == [True, False]

    dst = layout_writer.write_layout(back, str(tmp_path / "b"), config=cfg, tp=2, pp=1, weights_only=True)
    fresh = TransformerLanguageModel(cfg, ParallelTopology.single())
    assert not any(torch.equal(b, biases[i]) for i, b in _biases(fresh).items())
    reshard.load_weights(dst, [fresh], ParallelTopology.single())
    loaded = _biases(fresh)
    assert loaded.keys() == biases.keys() and len(loaded) == 2
    assert all(torch.equal(loaded[i], biases[i]) and loaded[i].dtype == torch.float32 for i in loaded)

    # a checkpoint from before the biases were recorded: they keep their values, one log line
    old = reshard.FullState(back.meta, {k: v for k, v in back.weights.items()
                                        if not k.endswith("expert_bias")})
    other = TransformerLanguageModel(cfg, ParallelTopology.single())
    before = _biases(other)
    with caplog.at_level("WARNING", logger="training.checkpoint.reshard"):
        reshard.copy_weights(old, [other], ParallelTopology.single(), "old", frozen_only=False)
    assert all(torch.equal(b, before[i]) for i, b in _biases(other).items())
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "old records no frozen parameters (written before they were saved layout-independently)"]
