"""The fields a GPT-2 config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import FULL, MHA

SHAPE = dict(MHA, **FULL, position_embedding="learned", embedding_layernorm=False)
MOE = False
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "conv1d"  # which PEFT target table (models/lora_targets.py) fits its layers
