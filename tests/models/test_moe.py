"""The MoE layer in one process, against a plain per-expert loop written from the definitions.

The batched experts, both router score orders (with and without renormalised top-k), capacity
dropping (GShard's position order), the shared expert and its gate: outputs and every gradient
equal the loop's (fp32, 1e-5); the auxiliary losses reach the gradients with the coefficient the
step sets; statistics count tokens per expert and dropped ones; bad configurations are refused.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megazoo.models.init import Initializer
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.models.moe import MoELayer, moe_layers, set_aux_loss_scale
from megazoo.parallel.topology import ParallelTopology
from tests.hf_models import moe_config

TOL = dict(rtol=1e-5, atol=1e-5)


def loop_reference(layer: MoELayer, x: torch.Tensor):
    """Output and aux loss of `layer` for tokens x [T, h], one expert at a time."""
    cfg, k, n = layer.config, layer.topk, layer.num_experts
    logits = (x @ layer.router.t()).float()
    probs = torch.softmax(logits, -1)
    if cfg.moe_router_pre_softmax:
        w, idx = probs.topk(k, -1)
        if cfg.moe_norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    else:
        top, idx = logits.topk(k, -1)
        w = torch.softmax(top, -1)
    cap = layer.capacity(x.shape[0])
    out = torch.zeros_like(x)
    e1, e2 = layer.experts.weight1, layer.experts.weight2
    for e in range(n):
        taken = 0
        for t in range(x.shape[0]):
            for j in range(k):
                if idx[t, j] != e:
                    continue
                taken += 1
                if cap is not None and taken > cap:
                    continue
                h = e1[e] @ x[t]
                if cfg.activation == "swiglu":
                    g, u = h.chunk(2)
                    h = F.silu(g) * u
                else:
                    h = F.gelu(h, approximate="tanh")
                out[t] = out[t] + w[t, j] * (e2[e] @ h)
    counts = torch.bincount(idx.flatten(), minlength=n).float()
    aux = cfg.moe_aux_loss_coeff * n * ((counts / (x.shape[0] * k)) * probs.mean(0)).sum()
    z = cfg.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return out, aux + z


def _layer(**kw) -> MoELayer:
    cfg = moe_config(**kw)
    return MoELayer(cfg, ParallelTopology.single(), Initializer(cfg), "layers.0.mlp.")


@pytest.mark.parametrize("kw", [
    dict(),  # Mixtral: top-k logits, softmax over them
    dict(moe_router_pre_softmax=True),  # Qwen2-MoE: softmax, top-k, not renormalised
    dict(moe_router_pre_softmax=True, moe_norm_topk_prob=True, moe_router_topk=3),  # Qwen3-MoE
    dict(moe_expert_capacity_factor=0.5),  # drops tokens
    dict(moe_expert_capacity_factor=1.0, activation="gelu_tanh"),
])
def test_routed_experts_equal_a_loop(kw):
    layer = _layer(**kw)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    r = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    out = layer.routed(x)
    ((out * r).sum()).backward()  # aux losses ride along with coefficient aux_loss_scale = 1
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}, x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref, aux = loop_reference(layer, x)
    aux_value = aux.detach()
    ((ref * r).sum() + aux).backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(got[1], x.grad, **TOL)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[0][n], p.grad, **TOL, msg=n)
    forwards, assignments, dropped, aux_v, _ = layer.stats.totals.tolist()
    assert forwards == 1 and assignments == 24 * layer.topk
    assert layer.stats.tokens_per_expert.sum() == assignments
    cap = layer.capacity(24)
    expect = 0 if cap is None else \
        int((layer.stats.tokens_per_expert - cap).clamp(min=0).sum())
    assert dropped == expect
    assert dropped > 0 or kw.get("moe_expert_capacity_factor", 1) >= 1
    assert math.isclose(aux_v, aux_value.item() - layer.stats.totals[4].item(), rel_tol=1e-5)


def test_aux_loss_scale_and_shared_expert_in_a_model():
    cfg = moe_config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                     moe_layer_freq=2, num_layers=3)
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    assert [type(l.mlp).__name__ for l in model.layers.values()] == \
        ["MoELayer", "ParallelMLP", "MoELayer"]
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    layer = model.layers["0"].mlp
    grads = []
    for scale in (1.0, 0.0, 3.0):
        set_aux_loss_scale([model], scale)
        model.zero_grad()
        model(ids, labels=labels).mean().backward()
        grads.append(layer.router.grad.clone())
    # The router's gradient is the LM part plus scale x the aux part: linear in the scale.
    torch.testing.assert_close(grads[2] - grads[1], 3 * (grads[0] - grads[1]), **TOL)
    assert not torch.allclose(grads[0], grads[1])
    assert layer.shared_expert_gate.grad is not None and layer.shared_expert.fc1.weight.grad is not None
    assert len(moe_layers(model)) == 2
    model.eval()
    before = layer.stats.totals.clone()
    with torch.no_grad():
        model(ids)
    assert torch.equal(before, layer.stats.totals)  # evaluation is not counted


@pytest.mark.parametrize("kw, match", [
    (dict(moe_router_topk=5), "--moe-router-topk 5 exceeds --num-experts 4"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
    (dict(moe_norm_topk_prob=True), "moe_norm_topk_prob applies to --moe-router-pre-softmax"),
    (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate needs"),
    (dict(moe_layer_freq=0), "--moe-layer-freq must be an integer >= 1"),
])
def test_bad_moe_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        moe_config(**kw)


def test_layouts_checked_against_experts():
    from megazoo.parallel.layout import LayoutError, ParallelConfig
    with pytest.raises(LayoutError, match="--num-experts 4 is not divisible by --expert-model-parallel-size 3"):
        moe_config().check_layout(ParallelConfig(ep=3))
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        moe_config(num_experts=None).check_layout(ParallelConfig(ep=2))
    with pytest.raises(LayoutError, match="--moe-shared-expert-intermediate-size 18"):
        moe_config(moe_shared_expert_intermediate_size=18).check_layout(ParallelConfig(tp=4))


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_experts_pad_groups_to_repeating_shapes(bias):
    """bf16 on the CPU rounds each expert's rows up to a multiple of 32 (oneDNN compiles a
    kernel per matmul shape): rows land in their padded places, and the layer's output and
    gradients equal fp32 arithmetic on the same bf16 weights, one expert at a time, to within
    bf16 rounding (2% of the norm; misplaced rows are off by about 100%)."""
    from megazoo.parallel.kernels.grouped_matmul import ONEDNN_ROW_MULTIPLE, pad_groups, padded_group_sizes
    sizes = torch.tensor([0, 1, 32, 33, 511, 512, 513, 1000, 1024, 5000, 70000])
    assert padded_group_sizes(sizes, 32).tolist() == \
        [0, 32, 32, 64, 512, 512, 544, 1024, 1024, 5120, 73728]
    big = torch.arange(1, 200_000)  # few distinct shapes at any scale, at most 6% more rows
    assert padded_group_sizes(big, 32).unique().numel() < 250
    assert (padded_group_sizes(big, 32) <= big * 1.0625 + 31).all()
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 40, 2])
    x0 = torch.randn(int(counts.sum()), 32, generator=g)
    grid, padded, rows = pad_groups(x0, counts, ONEDNN_ROW_MULTIPLE)
    assert padded.tolist() == [32, 0, 64, 32] and grid.shape[0] == 128
    torch.testing.assert_close(grid[rows], x0, rtol=0, atol=0)
    assert grid.abs().sum(1).count_nonzero() == x0.shape[0]
    assert rows.tolist()[:4] == [0, 1, 2, 32] and rows[-1] == 97

    layer = _layer(params_dtype="bfloat16", bias=bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3, generator=g)
    x = x0.to(torch.bfloat16).requires_grad_()
    r = torch.randn(x.shape[0], 32, generator=g)
    (layer.experts(x, counts).float() * r).sum().backward()
    got = [x.grad.float()] + [p.grad.float() for p in layer.experts.parameters()]
    xf = x.detach().float().requires_grad_()
    w = [p.detach().float().requires_grad_() for p in layer.experts.parameters()]
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = xf[start:start + n] @ w[0][e].t() + (w[2][e] if bias else 0)
        gate, up = h.chunk(2, -1)
        out.append((F.silu(gate) * up) @ w[1][e].t() + (w[3][e] if bias else 0))
        start += n
    (torch.cat(out) * r).sum().backward()
    for a, b in zip(got, [xf.grad] + [t.grad for t in w]):  # bf16 rounding: ~0.5% of the norm
        assert (a - b).norm() <= 2e-2 * b.norm(), ((a - b).norm() / b.norm()).item()


def test_megatron_flags_map_onto_the_config():
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    argv = ["--model", "moe-tiny", "--num-experts", "4", "--moe-router-topk", "1",
            "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "0.02", "--moe-z-loss-coeff",
            "0.003", "--moe-expert-capacity-factor", "1.25", "--moe-router-pre-softmax",
            "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "2",
            "--expert-model-parallel-size", "2", "--mock-data", "--train-iters", "1"]
    run = to_run_config(build_parser().parse_args(argv), world_size=4)
    m = run.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff,
            m.moe_z_loss_coeff, m.moe_expert_capacity_factor, m.moe_router_pre_softmax,
            m.moe_shared_expert_intermediate_size, m.moe_layer_freq) == \
        (4, 1, 64, 0.02, 0.003, 1.25, True, 32, 2)
    assert run.parallel.ep == 2
    with pytest.raises(ArgumentError, match="--expert-model-parallel-size 3 must divide"):
        to_run_config(build_parser().parse_args(argv[:-4] + ["3", "--mock-data", "--train-iters",
                                                             "1"]), world_size=4)
