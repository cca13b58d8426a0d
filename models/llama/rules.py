"""The fields a Llama config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON)."""
from ..family_bases import FULL, MHA, ROPE

SHAPE = dict(MHA, **ROPE, **FULL, add_qkv_bias=False, qk_layernorm=False)
INFER_BEFORE = ("mistral",)  # a Llama config fits Mistral's rules too (no window)
MOE = False
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "llama_like"  # which PEFT target table (models/lora_targets.py) fits its layers
