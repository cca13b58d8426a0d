"""Gemma 4 text, a family folder (models/gemma4_text/), against transformers' Gemma4ForCausalLM:
a random model with odd sizes and the features megazoo models on (5:1 sliding/full layers with
two RoPE bases, "proportional" partial RoPE on the full ones, grouped-query attention with a
decoupled head_dim and the full layers' own (global_head_dim), value norm, per-layer scalars
(perturbed away from 1), softmax scale 1, final logit softcapping, untied head), fp32; shrunk
copies of the released 26B-A4B config (attention_k_eq_v, the full layers' own key/value heads,
the MoE block) with and without its MoE block; the small releases' kind (KV sharing with wide
MLPs, per-layer inputs); each unmodelled feature is refused in one line. Logits within 1e-5,
greedy generation equal, export back bit-identical; in one 2-rank world tp2, pp2, sequence
parallelism and ep2 equal the unsharded model."""
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
    return _with_megazoo(hf)


def _with_megazoo(hf):
    """(hf, megazoo config, megazoo model with hf's weights), unsharded, in eval mode."""
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
                         ("use_bidirectional_attention", "all")):
        with pytest.raises(ValueError, match=f"^Gemma4 config.json: {field}="):
            adapter.config_from_hf(_hf_config(**{field: value}))


def test_logits_generation_and_export_equal_transformers(pair):
    hf, cfg, model = pair
    assert_equals_transformers(hf, cfg, model, adapter, VOCAB, SEQ, TOL)

def _grads(model, ids, topo=None, fused=False):
    """{name: full gradient} of the mean next-token loss on `ids` (each sequence's first token
    the last one's target), from the gathered (softcapped) logits, or `fused`: from megazoo's
    fused head-and-loss (the training path, which caps inside)."""
    from megazoo.models.language_model import gather_logits
    from megazoo.parallel.sharding import full_tensor
    model.zero_grad()
    targets = ids.roll(-1, dims=1)  # (the whole sequence in: sequence parallelism splits it)
    if fused:
        model(ids, labels=targets).mean().backward()
    else:
        logits = gather_logits(model(ids), topo or ParallelTopology.single(), VOCAB)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return {n: p.grad if topo is None else full_tensor(p, topo, p.grad)
            for n, p in model.named_parameters()}


GRAD_TOL = 3e-5  # of the model's largest gradient entry; see _grad_error


def _grad_error(model, topo, ids, ref, fused=False) -> float:
    """The worst gradient error against `ref`, over the model's largest reference gradient entry
    (a bound for the whole model, not per element: the last layer scalars' gradients are rounding
    noise near 0, the final norm undoing a scale of the residual stream). Above the 1e-5 of
    logits: an entry's error is the rounding of sums over every token and layer after it,
    amplified where a norm normalises a small vector; measured at tp2 8.5e-6 (the MoE model) and
    2.1e-5 (per-layer inputs: the word embedding, which also feeds every layer's input), both
    kernel sets, against 5e-6 between megazoo and transformers in one process. A parallel bug
    moves a whole tensor (an expert gradient counted on both ep ranks: 1.0). Under ep both ranks
    run the same batch, so each expert's gradient holds it twice."""
    scale = max(g.abs().max() for g in ref.values())
    worst = 0.0
    for n, g in _grads(model, ids, topo, fused).items():
        g = g / topo.ep if ".experts." in n else g
        want = ref[n]
        if g.shape != want.shape:  # the word embedding, padded per tp: its real rows
            g, want = g[:VOCAB], want[:VOCAB]
        error = ((g - want).abs().max() / scale).item()
        worst = max(worst, error if error == error else float("inf"))  # NaN is no match
    return worst


def _fused_bf16_softcap_error(topo, cap: float = 30.0) -> float:
    """The vocabulary-parallel fused loss in bf16 with Gemma's cap (c = 30, logits up to ~60, a
    shard holding padding) against F.cross_entropy of the capped fp32 logits of the same bf16
    inputs: the worst gradient error over the largest reference entry (6.1e-3: bf16 rounding;
    gradients taken from bf16-rounded capped logits, an earlier version, were off by 2.0e-2)."""
    from megazoo.parallel import collectives as C
    from megazoo.parallel.fused_cross_entropy import _LMHeadCrossEntropy
    g = torch.Generator().manual_seed(7)
    n, vocab, padded = 24, 50, 64  # tp2: rank 1 holds 18 real columns and 14 of padding
    x, w = torch.randn(n, 16, generator=g).bfloat16(), (2 * torch.randn(padded, 16, generator=g)).bfloat16()
    target = torch.randint(0, vocab, (n,), generator=g)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    logits = (torch.tanh(xr @ wr.t() / cap) * cap).masked_fill(torch.arange(padded) >= vocab,
                                                                 float("-inf"))
    torch.nn.functional.cross_entropy(logits, target, reduction="sum").backward()
    rows = slice(topo.tp_rank * padded // 2, (topo.tp_rank + 1) * padded // 2)
    xs, ws = x.clone().requires_grad_(), w[rows].clone().requires_grad_()
    _LMHeadCrossEntropy.apply(xs, ws, target, topo.tp_group, vocab, True, cap).sum().backward()
    dx = C.all_reduce(xs.grad.float(), topo.tp_group)  # (the model's copy_to_tp does this)
    scale = max(xr.grad.abs().max(), wr.grad.abs().max())
    worst = max((dx - xr.grad).abs().max(), (ws.grad.float() - wr.grad[rows]).abs().max())
    return (worst / scale).item()


def _worker(rank, cfg, full, ids, ref, released):
    import torch.distributed as dist

    from megazoo.models.language_model import gather_logits
    worst = {}
    layouts = {"tp2": ParallelConfig(tp=2), "tp2sp": ParallelConfig(tp=2, sequence_parallel=True),
               "ep2": ParallelConfig(ep=2)}
    for layout, parallel in layouts.items():  # one topology per layout: groups are slow to make
        topo = ParallelTopology.from_config(parallel)
        if layout == "tp2":
            worst["fused bf16 softcap"] = _fused_bf16_softcap_error(topo)
        for name, case in [("", (cfg, full, ids, ref, None))] * (layout == "tp2") + released:
            c, f, x, r, grads = case
            if layout == "ep2" and not c.num_experts or layout == "tp2sp" and grads is None:
                continue  # the experts' (dispatch, the router's sequence gather), KV sharing's
            model = build_model(c, topo).eval()
            load_full_state_dict(model, f, topo)
            with torch.no_grad():
                logits = gather_logits(model(x), topo, VOCAB)
            worst[f"{name}{layout}"] = (logits - r).abs().max().item()
            if grads is not None:  # and every gradient (the experts' through the dispatch)
                worst[f"{name}{layout} grads"] = _grad_error(model, topo, x, grads)
                if layout == "tp2":  # the training loss: vocabulary-parallel, softcapped inside
                    worst[f"{name}{layout} fused grads"] = _grad_error(model, topo, x, grads, True)
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


def _reference(model, seq):
    ids = torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)[..., :VOCAB]
    cfg = model.config
    grads = _grads(model, ids) if cfg.num_experts or cfg.kv_shared_layers else None
    return model.config, gather_full_state_dict(model, ParallelTopology.single()), ids, ref, grads


def test_tp2_pp2_and_ep2_equal_the_unsharded_model(pair, released_pairs, shared_pair):
    """One 2-rank world: the random model at tp2 and pp2; the shrunk releases at tp2, the MoE
    one also with sequence parallelism (the router's sequence gather) and ep2 (expert dispatch),
    the KV-sharing one (with per-layer inputs) at tp2 and with sequence parallelism; logits within
    1e-5 and (MoE, KV sharing) every gradient within 3e-5 of the model's largest (`_grad_error`)."""
    models = {**{name: model for name, (_, _, model) in released_pairs.items()},
              "kv-shared": shared_pair[2]}
    cases = [(name + " ", _reference(model, 16)) for name, model in models.items()]
    worst = run_distributed(_worker, 2, *_reference(pair[2], SEQ)[:4], cases, timeout=300)[1]
    assert set(worst) == {"tp2", "pp2", "31b-like tp2", "26b-a4b tp2", "26b-a4b tp2sp",
                          "26b-a4b ep2", "26b-a4b tp2 grads", "26b-a4b tp2sp grads",
                          "26b-a4b ep2 grads", "kv-shared tp2", "kv-shared tp2 grads",
                          "kv-shared tp2sp", "kv-shared tp2sp grads", "26b-a4b tp2 fused grads",
                          "kv-shared tp2 fused grads", "fused bf16 softcap"}, worst
    assert worst.pop("fused bf16 softcap") < 1e-2, worst
    assert max(v for k, v in worst.items() if "grads" not in k) < 1e-5, worst
    assert max(v for k, v in worst.items() if "grads" in k) < GRAD_TOL, worst


def _released_config(**overrides):
    """The released 26B-A4B text config (tests/fixtures/released_hf_configs.json) with every
    structural field kept (5 sliding : 1 full layers, attention_k_eq_v with the full layers' own
    key/value heads and head size, proportional partial RoPE, the MoE block, tied embeddings,
    softcapping) and its sizes cut."""
    import json
    import os

    from transformers import Gemma4TextConfig
    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                           "released_hf_configs.json")
    text = json.load(open(fixture))["gemma-4-26b-a4b"]["config"]["text_config"]
    fields = {k: v for k, v in text.items() if k not in ("model_type", "dtype", "use_cache")}
    fields.update(  # "vision" is causal over text (tested above); None round-trips
        use_bidirectional_attention=None, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
        hidden_size=40, intermediate_size=24, moe_intermediate_size=12, num_attention_heads=4,
        num_key_value_heads=2, num_global_key_value_heads=1, head_dim=8, global_head_dim=16,
        num_experts=8, top_k_experts=3, num_hidden_layers=6, layer_types=text["layer_types"][:6],
        sliding_window=5, max_position_embeddings=64, final_logit_softcapping=7.0)
    return Gemma4TextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def released_pairs():
    """{name: (HF model, config, megazoo model)}: the shrunk 26B-A4B, and the same without the MoE
    block (the dense 31B's kind: attention_k_eq_v, 4 global KV heads to 16)."""
    from transformers import Gemma4ForCausalLM
    out = {}
    for name, overrides in (("26b-a4b", {}), ("31b-like", dict(enable_moe_block=False, num_experts=None,
                                                           top_k_experts=None,
                                                           moe_intermediate_size=None))):
        torch.manual_seed(1)
        hf = perturbed(Gemma4ForCausalLM(_released_config(**overrides)))
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                layer.layer_scalar.fill_(0.8 + 0.05 * i)
        out[name] = _with_megazoo(hf)
    return out


def test_released_shapes_equal_transformers(released_pairs):
    """attention_k_eq_v (full layers: no v_proj, values = the k projection before its norm and
    RoPE, then the value norm; their own 1 KV head and head size) and the MoE block (a dense MLP
    and routed experts summed after their own norms; Gemma 4's router): logits within 1e-5,
    greedy generation (KV cache) equal, export bit-identical and loaded by transformers, the
    parameter count transformers' own."""
    from transformers import Gemma4ForCausalLM
    for name, (hf, cfg, model) in released_pairs.items():
        assert cfg.attention_k_eq_v and cfg.global_num_query_groups == 1
        full, sliding = cfg.layer_spec(5), cfg.layer_spec(0)
        assert (full.mixer.k_eq_v, full.mixer.kv_heads, full.mixer.head_dim) == (True, 1, 16)
        assert (sliding.mixer.k_eq_v, sliding.mixer.kv_heads) == (False, None)
        assert full.mlp.kind == ("dense_moe" if name == "26b-a4b" else "dense")
        assert_config_round_trip(hf, cfg, adapter)
        assert_equals_transformers(hf, cfg, model, adapter, VOCAB, SEQ, TOL)
        back = Gemma4ForCausalLM(adapter.hf_config(cfg)).eval()
        back.load_state_dict(adapter.to_hf_state_dict(
            gather_full_state_dict(model, ParallelTopology.single()), cfg), strict=False)
        ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            assert torch.equal(back(ids).logits, hf(ids).logits), name
        scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
        assert sum(p.numel() for p in hf.parameters()) + scalars == cfg.num_parameters(), name
    moe = released_pairs["26b-a4b"][1]
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 3, 12)
    with pytest.raises(ValueError, match="^Gemma4 export: moe_per_expert_scale=False "):
        adapter.hf_config(moe.replace(moe_per_expert_scale=False))
    with pytest.raises(ValueError, match="^Gemma4 export: global_num_query_groups=1 without "):
        adapter.hf_config(moe.replace(attention_k_eq_v=False))
    with pytest.raises(ValueError, match="^global_num_query_groups 3 .* --tensor-model-parallel"):
        moe.replace(num_attention_heads=6, global_num_query_groups=3).check_layout(
            ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="^moe_router_input_norm is an option of MoE layers: set --num-experts"):
        moe.replace(num_experts=None)


@pytest.fixture(scope="module")
def shared_pair():
    """The small releases' (E2B/E4B) kind: KV sharing, the random model's last 3 layers (two
    sliding, one full) attending with layer 3's and layer 2's keys and values, with MLPs twice as
    wide; per-layer inputs of size 6 from a vocabulary of their own; attention_k_eq_v on the full
    layers."""
    from transformers import Gemma4ForCausalLM
    torch.manual_seed(2)
    hf = perturbed(Gemma4ForCausalLM(_hf_config(
        num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=True,
        num_global_key_value_heads=1, hidden_size_per_layer_input=6,
        vocab_size_per_layer_input=VOCAB + 5)))
    return _with_megazoo(hf)


def test_kv_sharing_and_per_layer_inputs_equal_transformers(shared_pair):
    """Logits within 1e-5, greedy generation (the sharing layers read the earlier layers' cached
    keys and values) equal, export bit-identical, the parameter count and every gradient (within
    1e-5 of the largest) transformers'."""
    from megazoo.models.generation import SamplingConfig, generate
    from megazoo.parallel.errors import LayoutError
    hf, cfg, model = shared_pair
    assert [cfg.kv_source(i) for i in range(7)] == [None] * 4 + [3, 3, 2]
    assert cfg.kv_producers() == {2, 3} and cfg.kv_shared_double_mlp
    assert [cfg.layer_spec(i).mlp.width for i in (3, 4)] == [None, 140]
    assert (cfg.per_layer_input_size, cfg.per_layer_input_vocab_size) == (6, VOCAB + 5)
    assert_config_round_trip(hf, cfg, adapter)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :VOCAB], hf(ids).logits, **TOL)
    out = generate(model, ParallelTopology.single(), ids[:, :6], 8, SamplingConfig(greedy=True))
    want = hf.generate(ids[:, :6], max_new_tokens=8, do_sample=False, min_new_tokens=8,
                       eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)
    back = adapter.to_hf_state_dict(gather_full_state_dict(model, ParallelTopology.single()), cfg)
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(back[k], t) for k, t in hf.state_dict().items())
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
    assert sum(p.numel() for p in hf.parameters()) + scalars == cfg.num_parameters()
    grads = _grads(model, ids)  # the earlier layers' k projections get the sharing layers' part
    for name in ("embedding.word_embeddings.weight", "head_weight"):
        grads[name] = grads[name][:VOCAB]
    grads = adapter.to_hf_state_dict(grads, cfg)
    hf.zero_grad()
    logits = hf(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    want = {n: p.grad for n, p in hf.named_parameters()}
    scale = max(g.abs().max() for g in want.values())
    assert max((grads[n] - g).abs().max() / scale for n, g in want.items()) < 1e-5
    with pytest.raises(LayoutError, match="^kv_shared_layers 3 needs --pipeline-model-parallel"):
        cfg.check_layout(ParallelConfig(pp=2, first_stage_layers=4))
    with pytest.raises(ValueError, match="^kv_shared_layers 5: layer 2 .full attention. has no "):
        cfg.replace(kv_shared_layers=5)
    with pytest.raises(ValueError, match="^kv_shared_layers with --recompute-granularity full"):
        cfg.replace(recompute_granularity="full")
    with pytest.raises(ValueError, match="^per_layer_input_size with --recompute-granularity"):
        cfg.replace(recompute_granularity="full", kv_shared_layers=0, kv_shared_double_mlp=False)
    with pytest.raises(LayoutError, match="^per_layer_input_size 6 needs --pipeline-model-par"):
        cfg.replace(kv_shared_layers=0, kv_shared_double_mlp=False).check_layout(
            ParallelConfig(pp=2, first_stage_layers=4))


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


def test_softcap_with_prediction_heads_is_refused_at_configuration():
    """The fused loss caps the main head's logits; the MTP heads' loss does not: refused when the
    config is made, not at the first training step."""
    from megazoo.models.config import TransformerConfig
    with pytest.raises(ValueError, match="final_logit_softcapping with --mtp-num-layers"):
        TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                          mtp_num_layers=1, final_logit_softcapping=30.0)
