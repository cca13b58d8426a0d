"""The planner and the dry run know the hybrid layer kinds (models/hybrid_counts.py,
training/planning/hybrid.py, hybrid_dry_run.py): each published preset's parameter count equals
transformers' own model built on meta; FLOPs per token equal a hand count; the published sizes
plan at a published or planned layout; the bytes autograd saves, measured on meta at full scale
and on real tensors of a small model, equal the planner's per-layer estimate; activation memory
per context-parallel rank falls with cp; `tools/dry_run.py --model <hybrid preset>` runs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 - autouse

GiB = 2 ** 30


def _hf_count(cls, config) -> int:
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


def _h100(n):
    from megazoo.training.planning.reference_runs import CLUSTERS
    return CLUSTERS["dgx-h100-80gb"].replace(num_gpus=n)


def test_parameters_equal_transformers_on_meta():
    import transformers

    from megazoo.models import hybrid_counts as hc
    from megazoo.models.nemotron_h import presets as nh
    from megazoo.models.qwen3_5 import presets as q35
    from megazoo.models.qwen3_5_moe_text import presets as q35moe
    from megazoo.models.qwen3_next import presets as qn
    checked = []
    for presets, cls, cfg_cls in ((q35, "Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
                                  (qn, "Qwen3NextForCausalLM", "Qwen3NextConfig"),
                                  (q35moe, "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"),
                                  (nh, "NemotronHForCausalLM", "NemotronHConfig")):
        for name, fields in getattr(presets, "HF_PRESETS", presets.PRESETS).items():
            hf_config = getattr(transformers, cfg_cls)(**fields)
            counted = hc.num_parameters(hc.describe(presets.preset_config(name)))
            assert counted == _hf_count(getattr(transformers, cls), hf_config), name
            checked.append((name, counted))
    # Qwen3.5-35B-A3B (the qwen3_5_moe_text family's released size) and transformers' own
    # Qwen3_5MoeTextConfig defaults: the same shape
    shape = hc.describe(q35moe.preset_config("qwen3.5-35b-a3b"))
    defaults = transformers.Qwen3_5MoeTextConfig()
    assert hc.num_parameters(shape) == _hf_count(transformers.Qwen3_5MoeForCausalLM, defaults)
    sizes = dict(checked)
    assert round(sizes["nemotron-h-56b"] / 1e9) == 56 and round(sizes["nemotron-h-47b"] / 1e9) == 47
    assert round(sizes["qwen3.5-35b-a3b"] / 1e9) == 35 and round(sizes["qwen3-next-80b-a3b"] / 1e9) == 80
    # active parameters of the MoE sizes: the "A3B" of their names
    assert 2.5e9 < hc.num_parameters(shape, active=True) < 3.5e9
    assert 2.5e9 < hc.num_parameters(hc.describe(qn.preset_config("qwen3-next-80b-a3b")), active=True) < 4e9
    # a TP rank holds 1/tp of each mixer's split tensors (the replicated norms whole)
    nem = hc.describe(nh.preset_config("nemotron-h-8b"))
    whole, half = hc.layer_parameters(nem, 0, 1), hc.layer_parameters(nem, 0, 2)
    assert half[0] == pytest.approx((whole[0] - 4096) / 2 + 4096)
    assert len(checked) == 7


def test_flops_per_token_by_hand():
    from megazoo.models import hybrid_counts as hc
    from megazoo.models.gated_deltanet import GatedDeltaNetShape
    from megazoo.models.mamba2 import Mamba2Shape
    h, s = 64, 256
    g = GatedDeltaNetShape(h, key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=8,
                           conv_kernel=4, chunk_size=32)
    # projections: qkv 2*32 + 32 = 96 rows, z 32, a and b 4 each; out 32 columns
    proj = 2 * (h * (96 + 32 + 4 + 4) + 32 * h)
    # conv over 96 channels; per value head and token: kk^T and qk^T 32*16 each, the solve
    # 32*(16 + 8)/2, scores@u 32*8, and three dk x dv products
    rule = 4 * (32 * 16 * 2 + 32 * 24 / 2 + 32 * 8 + 3 * 16 * 8)
    assert hc.mixer_flops_per_token(g, h, s) == (proj, 2 * (4 * 96 + rule))
    m = Mamba2Shape(h, heads=4, head_dim=16, state_size=8, groups=2, conv_kernel=4, chunk_size=32)
    # in_proj: z 64 + xBC (64 + 2*2*8) + dt 4 rows; out 64 columns; conv 96 channels; SSD per
    # head and token: CB^T 32*8, its product with x 32*16, state read and write 2*16*8
    assert hc.mixer_flops_per_token(m, h, s) == (
        2 * (h * (64 + 96 + 4) + 64 * h), 2 * (4 * 96 + 4 * (32 * 8 + 32 * 16 + 2 * 16 * 8)))
    a = hc.AttentionShape(heads=4, kv_heads=2, head_dim=16, gated=True)
    assert hc.mixer_flops_per_token(a, h, s) == (2 * (h * (128 + 64) + 64 * h), 4 * s * 64)
    moe = hc.MoEMLP(experts=8, topk=2, size=24, shared=16, shared_gate=True)
    assert hc.mlp_flops_per_token(moe, h) == (2 * (3 * h * 16 + h), 2 * (8 * h + 2 * 3 * h * 24))
    # a short sequence is one chunk of its own length
    assert hc.mixer_flops_per_token(g, h, 8)[1] < hc.mixer_flops_per_token(g, h, s)[1]


def test_published_sizes_plan():
    from megazoo.models import hybrid_counts as hc
    from megazoo.models.nemotron_h.presets import preset_config as nemotron
    from megazoo.models.qwen3_5.presets import preset_config as qwen35
    from megazoo.models.qwen3_next.presets import preset_config as qwen_next
    from megazoo.training.planning import hybrid
    from megazoo.training.planning.layout import Layout
    from megazoo.training.planning.memory import PlanError
    common = dict(zero_stage=1, params_dtype="bfloat16", flash_attention=True, micro_batch_size=1)
    runs = {  # NVIDIA's 56B: 8K context, tp8; the others planned
        "nemotron-h-56b": (nemotron("nemotron-h-56b"), 64, Layout.of(
            tp=8, pp=4, first_stage_layers=28, dp=2, sequence_parallel=True, seq_length=8192,
            global_batch_size=64, recompute_granularity="full", **common)),
        "nemotron-h-47b": (nemotron("nemotron-h-47b"), 64, Layout.of(
            tp=8, pp=2, dp=4, sequence_parallel=True, seq_length=8192, global_batch_size=64,
            recompute_granularity="full", **common)),
        "nemotron-h-8b": (nemotron("nemotron-h-8b"), 8, Layout.of(
            tp=2, dp=4, seq_length=8192, global_batch_size=32, recompute_granularity="full", **common)),
        "qwen3.5-9b": (qwen35("qwen3.5-9b"), 16, Layout.of(
            tp=2, dp=2, cp=4, seq_length=32768, global_batch_size=32, recompute_granularity="full",
            **common)),
        "qwen3-next-80b-a3b": (qwen_next("qwen3-next-80b-a3b"), 64, Layout.of(
            tp=2, pp=4, dp=8, ep=8, sequence_parallel=True, seq_length=4096, global_batch_size=256,
            recompute_granularity="full", **common)),
    }
    checked = 0
    from megazoo.training.planning import planner
    for name, (config, gpus, layout) in runs.items():
        p = planner.plan(config, layout, _h100(gpus))  # the planner's entry point dispatches
        assert isinstance(p, hybrid.HybridPlan)
        shape = hc.describe(config)
        assert p.fits and 0 < p.memory.total < 80 * GiB, (name, p.memory.total / GiB)
        assert 0.05 < p.time.mfu < 0.7 and p.time.total > 0, name
        assert sum(sum(st.kinds.values()) for st in p.stages) == shape.num_layers
        assert sum(st.layers[-1] - st.layers[0] + 1 for st in p.stages) == shape.num_layers
        # the KV cache only for attention layers, the linear layers' state whatever the length
        longer = hc.generation_cache_bytes(shape, 1, 2 * layout.seq_length, layout.tp)
        short = hc.generation_cache_bytes(shape, 1, layout.seq_length, layout.tp)
        assert longer["state"] == short["state"] > 0 and longer["kv"] == 2 * short["kv"] > 0
        assert "stage 0" in hybrid.describe_plan(name, p)
        checked += 1
    # mixed kinds cost differently: Nemotron-H-56B's stages (same layer counts) differ in FLOPs
    p = hybrid.plan(*runs["nemotron-h-56b"][::2][:1], runs["nemotron-h-56b"][2], _h100(64))
    flops = [st.flops_per_microbatch for st in p.stages[1:3]]
    assert [len(st.layers) for st in p.stages[1:3]] == [30, 30] and flops[0] != flops[1]
    # activations per rank fall with cp; the cp wavefront and state messages cost time
    config, _, base = runs["qwen3.5-9b"]
    acts = [hybrid.plan(config, base.replace(cp=c, dp=16 // (2 * c)), _h100(16)).memory.activations
            for c in (1, 2, 4)]
    assert acts[0] > acts[1] > acts[2]
    # refused in one line: tp not dividing the Mamba-2 groups
    with pytest.raises(PlanError, match="Mamba layers' groups") as err:
        hybrid.plan(nemotron("nemotron-h-8b"), runs["nemotron-h-8b"][2].replace(tp=16, dp=1),
                    _h100(16))
    assert "\n" not in str(err.value)
    assert checked == 5


def test_cp_linear_layers_by_heads_or_chain(monkeypatch):
    """Context parallelism's time for linear layers: by heads (the trainer's rule) a layer takes
    one slot of s/cp tokens, so a rank's compute at cp4 is a quarter of cp1's exactly, plus the
    all-to-alls (counted by hand here); where the heads do not split, the chain's wavefront
    (n + cp - 1 slots per run of n linear layers)."""
    from megazoo.models import hybrid_counts as hc
    from megazoo.models.gated_deltanet import GatedDeltaNetShape
    from megazoo.models.mamba2 import Mamba2Shape
    from megazoo.models.qwen3_5.presets import preset_config as qwen35
    from megazoo.training.planning import hybrid
    from megazoo.training.planning.layout import Layout
    g = GatedDeltaNetShape(64, key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=8)
    m = Mamba2Shape(64, heads=8, head_dim=16, state_size=8, groups=2)
    # the rule: heads over tp x cp, groups divided or repeated (Gated DeltaNet's key heads at cp4,
    # Mamba-2's 2 groups at tp2 x cp2: one per TP rank, repeated on both context ranks)
    assert [hybrid.by_heads(g, 1, c) for c in (1, 2, 4, 8)] == [False, True, True, False]
    assert hybrid.by_heads(m, 2, 2) and hybrid.by_heads(m, 2, 4) and not hybrid.by_heads(m, 2, 8)
    assert not hybrid.by_heads(GatedDeltaNetShape(64, 1, 3, 16, 8), 1, 2)
    # the all-to-alls by hand, per pass, 1024 tokens, bf16: Gated DeltaNet at cp4 sends q and k
    # (its 2 key heads repeated: 4 x 16 each), v 32, b and a 4 each, and gets its output (32)
    assert hybrid.heads_exchange_bytes(g, 1024, 1, 4, 2) == 3 / 4 * 256 * (
        (2 * 64 + 32 + 8) * 2 + 32 * 2)
    # Mamba-2 at tp2 x cp2: x 64, B and C 8 each (one group per TP rank, repeated), dt 4; the
    # scan's fp32 output 64
    assert hybrid.heads_exchange_bytes(m, 1024, 2, 2, 2) == 1 / 2 * 512 * (
        (64 + 2 * 16 + 4) * 2 + 64 * 4)
    # Qwen3.5-9B (3 Gated DeltaNet + 1 attention, 16 key heads) at tp2: by heads at cp4
    config, cluster = qwen35("qwen3.5-9b"), _h100(32)
    shape = hc.describe(config)
    base = Layout.of(tp=2, dp=4, zero_stage=1, params_dtype="bfloat16", micro_batch_size=1,
                     global_batch_size=16, seq_length=32768, flash_attention=True)
    one, four = (hybrid.step_time(shape, base.replace(cp=c), cluster) for c in (1, 4))
    assert four.compute * 4 == pytest.approx(one.compute, rel=1e-12)
    attention = [i for i, layer in enumerate(shape.layers) if layer.kind == "attention"]
    assert hybrid._wavefront(shape, list(range(shape.num_layers)), 4, 2) == shape.num_layers
    # the chain where the heads do not split: each run of 3 linear layers takes 3 + 3 slots
    monkeypatch.setattr(hybrid, "by_heads", lambda *args: False)
    chain = hybrid.step_time(shape, base.replace(cp=4), cluster)
    assert hybrid._wavefront(shape, list(range(shape.num_layers)), 4, 2) == \
        shape.num_layers + 3 * len(attention)
    assert chain.compute > four.compute and chain.cp_comm < four.cp_comm
    assert chain.total > four.total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dry_run_meta_measured_equals_planned(dtype):
    """One cp rank of Nemotron-H-8B and Qwen3.5-9B at 4K / cp2 on meta: parameters as built equal
    the count, and the bytes each layer saves equal the planner's within 1% (linear and MLP
    layers) and 6% (attention)."""
    from megazoo.models.nemotron_h.model import NemotronHForCausalLM
    from megazoo.models.nemotron_h.presets import preset_config as nemotron
    from megazoo.models.qwen3_5.model import Qwen35ForCausalLM
    from megazoo.models.qwen3_5.presets import preset_config as qwen35
    from megazoo.training.planning import hybrid_dry_run as D
    from megazoo.training.planning.layout import Layout
    layout = Layout.of(tp=1, dp=4, cp=2, zero_stage=1, global_batch_size=32, seq_length=4096,
                       flash_attention=True, params_dtype=dtype)
    kinds = {}
    for config, cls in ((nemotron("nemotron-h-8b"), NemotronHForCausalLM),
                        (qwen35("qwen3.5-9b"), Qwen35ForCausalLM)):
        r = D.dry_run(config, cls, layout, _h100(8))
        assert r.built_parameters == r.counted_parameters
        for kind, (measured, planned) in r.by_kind().items():
            kinds[kind] = measured / planned
            assert measured == pytest.approx(planned, rel=0.06 if kind == "attention" else 0.01), kind
    assert set(kinds) == {"mamba2", "mlp", "attention", "gated_deltanet"}


def _slices_saved_bytes(model, ids, cp):
    """Per cp rank: bytes saved per layer while the rank runs its contiguous slice, starting from
    the state the earlier ranks hand over (their slices run first, without a graph), and the
    rank's logits."""
    from megazoo.models.hybrid_cache import HybridCache
    from megazoo.training.planning.hybrid_dry_run import measure_saved_bytes
    n = ids.shape[1] // cp
    out, logits = [], []
    for r in range(cp):
        cache = HybridCache()
        with torch.no_grad():
            if r:
                model(ids[:, :r * n], cache=cache)
        with measure_saved_bytes(model) as saved:
            y = model(ids[:, r * n:(r + 1) * n], cache=cache)
        y.sum().backward()  # the graph was real
        out.append(dict(saved))
        logits.append(y.detach())
    return out, torch.cat(logits, 1)


def test_activation_memory_falls_with_cp():
    """A small Nemotron-H (Mamba-2, MLP, attention) and Qwen3.5 (Gated DeltaNet, gated attention),
    fp32, 64 tokens at cp 1, 2, 4: each rank's slice continued from the state passed to it gives
    the whole run's logits, the bytes its linear and MLP layers save equal the planner's to 3%
    (16-token slices: two chunks, where the per-sequence terms weigh most; attention's at rank 0,
    with no earlier keys, to 15%), and the most any rank saves falls with cp."""
    from transformers import NemotronHConfig, Qwen3_5TextConfig

    from megazoo.models import hybrid_counts as hc
    from megazoo.models.nemotron_h import hf as nh_hf
    from megazoo.models.nemotron_h.model import NemotronHForCausalLM
    from megazoo.models.qwen3_5 import hf as q_hf
    from megazoo.models.qwen3_5.model import Qwen35ForCausalLM
    from megazoo.training.planning import hybrid
    from megazoo.training.planning.layout import Layout
    torch.manual_seed(0)
    nem = dataclasses.replace(nh_hf.config_from_hf(NemotronHConfig(
        vocab_size=61, hidden_size=32, hybrid_override_pattern="M-*M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4)), chunk_size=8)
    qwen = dataclasses.replace(q_hf.config_from_hf(Qwen3_5TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4)), chunk_size=8)
    ids = torch.randint(0, 61, (2, 64), generator=torch.Generator().manual_seed(3))
    peaks, checked = {}, 0
    for name, config, cls in (("nemotron_h", nem, NemotronHForCausalLM),
                              ("qwen3_5", qwen, Qwen35ForCausalLM)):
        model = cls(config)
        shape = hc.describe(config)
        with torch.no_grad():
            whole = model(ids)
        for cp in (1, 2, 4):
            per_rank, logits = _slices_saved_bytes(model, ids, cp)
            torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
            layout = Layout.of(cp=cp, dp=1, micro_batch_size=2, global_batch_size=2,
                               seq_length=64, params_dtype="float32", flash_attention=True)
            for r, saved in enumerate(per_rank):
                for i, layer in enumerate(shape.layers):
                    if layer.kind == "attention" and r > 0:
                        continue  # its keys include the earlier ranks' (a cache, not a ring)
                    planned = hybrid.layer_activation_bytes(shape, layout, i)
                    # attention: on CPU o_proj's input is a view of the kernel's output, which
                    # the planner (as for transformers, memory.py) counts twice
                    rel = 0.15 if layer.kind == "attention" else 0.03
                    assert saved[i] == pytest.approx(planned, rel=rel), (name, cp, r, i)
                    checked += 1
            peaks[name, cp] = max(sum(v for k, v in saved.items() if k != "other")
                                  for saved in per_rank)
        assert peaks[name, 1] > peaks[name, 2] > peaks[name, 4], peaks
        assert peaks[name, 1] / peaks[name, 4] > 2.5
    assert checked > 40


def test_dry_run_cli_hybrid_preset(capsys):
    """`tools/dry_run.py --model nemotron-h-8b`: through the registry once it lists the family
    (the trainer's meta dry run), through the hybrid dry run until then."""
    from megazoo.models.registry import FAMILIES
    from megazoo.tools import dry_run
    argv = ["--model", "nemotron-h-8b", "--world-size", "8", "--tensor-model-parallel-size", "2",
            "--context-parallel-size", "2", "--zero-stage", "1", "--bf16", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--seq-length", "4096", "--ranks", "first"]
    result = dry_run.main(argv)
    text = capsys.readouterr().out
    if "nemotron_h" in FAMILIES:
        assert result and "rank 0" in text
    else:
        assert result.built_parameters == result.counted_parameters == 8_100_852_736
        assert "parameters: built 8,100,852,736, counted 8,100,852,736 (equal)" in text
        assert "mamba2: one cp rank" in text and "stage 0" in text


def test_layer_spec_configs_describe_alike():
    """A TransformerConfig that names the hybrid kinds in `token_mixers` (the registry's form of
    these families: layer_mlps, linear_* and mamba_* fields) is described as its family config:
    the same counts. Spelled here as the fields such a config carries."""
    from types import SimpleNamespace

    from megazoo.models import hybrid_counts as hc
    from megazoo.models.nemotron_h.presets import preset_config as nemotron
    from megazoo.models.qwen3_5.presets import preset_config as qwen35
    from megazoo.models.qwen3_next.presets import preset_config as qwen_next

    def config(**kw):
        base = dict(bias=False, add_qkv_bias=False, layernorm_epsilon=1e-6, linear_conv_kernel=4,
                    linear_num_key_heads=None, mamba_num_heads=None, tie_word_embeddings=False,
                    layer_mlps=None, num_experts=None, moe_shared_expert_intermediate_size=None,
                    moe_shared_expert_gate=False, mamba_time_step_min=0.0, mamba_conv_bias=True,
                    mamba_proj_bias=False, qk_layernorm=False)
        c = SimpleNamespace(**{**base, **kw})
        c.is_moe_layer = lambda i: bool(c.num_experts)
        return c

    qwen = dict(vocab_size=248320, hidden_size=4096, num_attention_heads=16, num_query_groups=4,
                head_dim=256, ffn_hidden_size=12288, gated_mlp=True, qk_layernorm=True,
                token_mixers=("gated_deltanet",) * 3 + ("gated_attention",), linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_chunk_size=64)
    q = config(**{**qwen, "token_mixers": qwen["token_mixers"] * 8})
    nxt = config(**{**qwen, "vocab_size": 151936, "hidden_size": 2048, "num_query_groups": 2,
                    "ffn_hidden_size": 5632, "token_mixers": qwen["token_mixers"] * 12,
                    "num_experts": 512, "moe_router_topk": 10, "moe_ffn_hidden_size": 512,
                    "moe_shared_expert_intermediate_size": 512, "moe_shared_expert_gate": True})
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    n = config(vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
               head_dim=128, ffn_hidden_size=21504, gated_mlp=False, linear_chunk_size=128,
               layernorm_epsilon=1e-5, mamba_num_heads=128, mamba_head_dim=64,
               mamba_state_size=128, mamba_groups=8, mamba_time_step_min=0.001,
               token_mixers=tuple({"M": "mamba2", "*": "attention", "-": "none"}[x] for x in pattern),
               layer_mlps=tuple("dense" if x == "-" else "none" for x in pattern))
    for spec_config, family in ((q, qwen35("qwen3.5-9b")), (nxt, qwen_next("qwen3-next-80b-a3b")),
                                (n, nemotron("nemotron-h-8b"))):
        assert hc.is_hybrid(spec_config)
        a, b = hc.describe(spec_config), hc.describe(family)
        assert hc.num_parameters(a) == hc.num_parameters(b)
        assert hc.forward_flops_per_token(a, 4096) == hc.forward_flops_per_token(b, 4096)
        assert [layer.kind for layer in a.layers] == [layer.kind for layer in b.layers]
