"""The fields a Qwen2 config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import MHA, ROPE

SHAPE = dict(MHA, **ROPE, add_qkv_bias=True, qk_layernorm=False, bias=False)
MOE = False
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "llama_like"  # which PEFT target table (models/lora_targets.py) fits its layers
