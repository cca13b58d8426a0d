"""The fields a Qwen2-MoE config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import FULL, ROPE, SOFTMAX_ROUTER

SHAPE = dict(SOFTMAX_ROUTER, **ROPE, **FULL, qk_layernorm=False, bias=False)
MOE = True
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "moe_attention"  # which PEFT target table (models/lora_targets.py) fits its layers
