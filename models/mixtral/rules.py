"""The fields a Mixtral config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import ROPE, SOFTMAX_ROUTER

SHAPE = dict(SOFTMAX_ROUTER, **ROPE, add_qkv_bias=False, qk_layernorm=False,
             full_attention_layers=(), moe_shared_expert_intermediate_size=None,
             moe_shared_expert_gate=False)
INFER_BEFORE = ("qwen2_moe",)  # a Mixtral config without window or bias fits Qwen2-MoE's too
MOE = True
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "moe_attention"  # which PEFT target table (models/lora_targets.py) fits its layers
