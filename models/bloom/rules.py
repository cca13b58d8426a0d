"""The fields a BLOOM config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import FULL, MHA

SHAPE = dict(MHA, **FULL, position_embedding="alibi", embedding_layernorm=True)
MOE = False
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "fused_qkv"  # which PEFT target table (models/lora_targets.py) fits its layers
