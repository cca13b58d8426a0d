"""The fields a DeepSeek-V3 config fixes (models/family_rules.py reads SHAPE, MOE and
MEGATRON).

The family is the multi-latent-attention stack: its layers may be dense or MoE ("mixed"), so a
dense MLA model (Megatron-core's MLA GPTModel without experts, models/mla.py) is one too, and its
router's score function is a setting, not the family's (HF's DeepseekV3Config, which records
neither a dense model nor softmax routing, refuses both at export: adapter.hf_config)."""
from ..family_bases import CLASSIC, FULL, ROPE

SHAPE = dict(CLASSIC, **ROPE, **FULL, moe_router_bias=False, add_qkv_bias=False,
             qk_layernorm=False, bias=False)
MOE = "mixed"
NEEDS = ("kv_lora_rank",)  # multi-latent attention makes the family
MEGATRON = False  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "mla"  # which PEFT target table (models/lora_targets.py) fits its layers
