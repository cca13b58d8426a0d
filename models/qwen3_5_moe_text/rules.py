"""The fields a Qwen3.5-MoE text config fixes (models/family_rules.py reads SHAPE and MOE):
Qwen3.5's layers, every MLP sparse (no dense layer), the softmax router's renormalised top-k and
a gated shared expert."""
from ..family_bases import QWEN35_LAYERS

SHAPE = dict(QWEN35_LAYERS, layer_mlps=None, moe_layer_freq=1, moe_router_score_function="softmax",
             moe_router_pre_softmax=True, moe_norm_topk_prob=True, moe_router_bias=False,
             moe_router_enable_expert_bias=False, moe_router_num_groups=None,
             moe_router_topk_scaling_factor=None, moe_shared_expert_gate=True)
MOE = True
