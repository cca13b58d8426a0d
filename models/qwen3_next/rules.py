"""The fields a Qwen3-Next config fixes (models/family_rules.py reads SHAPE and MOE): Qwen3.5's
layers with a softmax-router mixture of experts and a gated shared expert."""
from ..family_bases import QWEN35_LAYERS

SHAPE = dict(QWEN35_LAYERS, moe_router_score_function="softmax", moe_router_pre_softmax=True,
             moe_router_bias=False, moe_router_enable_expert_bias=False,
             moe_router_num_groups=None, moe_router_topk_scaling_factor=None,
             moe_shared_expert_gate=True)
MOE = True
# a config naming no family whose every MLP is sparse with renormalised top-k fits Qwen3.5-MoE's
# rules too (the same layers and block): it stays Qwen3-Next, as before that family existed
INFER_BEFORE = ("qwen3_5_moe_text",)
