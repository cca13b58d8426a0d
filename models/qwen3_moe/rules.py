"""The fields a Qwen3-MoE config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import FULL, ROPE, SOFTMAX_ROUTER

SHAPE = dict(SOFTMAX_ROUTER, **ROPE, **FULL, add_qkv_bias=False, qk_layernorm=True,
             bias=False)
MOE = True
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "moe_attention"  # which PEFT target table (models/lora_targets.py) fits its layers
