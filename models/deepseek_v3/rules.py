"""The fields a DeepSeek-V3 config fixes (models/family_rules.py reads SHAPE, MOE, NEEDS and
MEGATRON).

The family is DeepSeek-V3's layer stack as Megatron-LM and Hugging Face hold it: multi-latent
or grouped-query attention (--kv-lora-rank or not), dense or MoE layers ("mixed":
config.layer_mlps names which), a softmax or sigmoid router (its score function is a setting,
not the family's). A config needs multi-latent attention or experts to be one, so a plain
Llama/Qwen config (neither) is never taken for it, and an MoE config that a softmax-router
family (Mixtral, Qwen-MoE) describes is inferred as that family first (MOE_FAMILIES are tried
before the mixed ones). Hugging Face's DeepseekV3Config records only MLA with MoE layers and
sigmoid routing: its adapter refuses the other forms at export (adapter.hf_config)."""
from ..family_bases import CLASSIC, FULL, ROPE

SHAPE = dict(CLASSIC, **ROPE, **FULL, moe_router_bias=False, add_qkv_bias=False,
             qk_layernorm=False, bias=False)
MOE = "mixed"
NEEDS = (("kv_lora_rank", "num_experts"),)  # multi-latent attention or experts, at least one
MEGATRON = True  # whether the Megatron-core tensor layout (training/checkpoint/foreign) covers it
LORA = "mla"  # which PEFT target table (models/lora_targets.py) fits its layers
