"""The fields a DeepSeek-V3 config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import CLASSIC, FULL, ROPE

SHAPE = dict(CLASSIC, **ROPE, **FULL, moe_router_bias=False, add_qkv_bias=False,
             qk_layernorm=False, bias=False, moe_router_score_function="sigmoid")
MOE = True
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "mla"  # which PEFT target table (models/lora_targets.py) fits its layers
