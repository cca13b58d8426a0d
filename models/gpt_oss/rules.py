"""The fields a gpt-oss config fixes (models/family_rules.py reads SHAPE and MOE)."""

from ..family_bases import GEMMA4_OFF

SHAPE = dict(GEMMA4_OFF, position_embedding="rope", normalization="rmsnorm", activation="swiglu_clamped",
             embedding_layernorm=False, post_norms=False, value_norm=False, layer_scalar=False, global_kv_channels=None,
             embedding_scale=False,
             qk_layernorm=False, bias=True, add_qkv_bias=False, attention_sinks=True,
             kv_lora_rank=None, mtp_num_layers=0, token_mixers=None, rope_local_theta=None,
             query_pre_attn_scalar=None, attn_logit_softcapping=None,
             final_logit_softcapping=None, moe_router_bias=True,
             moe_router_score_function="softmax", moe_router_pre_softmax=False,
             moe_router_enable_expert_bias=False, moe_router_num_groups=None,
             moe_router_topk_scaling_factor=None, moe_first_dense_layers=0, moe_layer_freq=1,
             moe_shared_expert_intermediate_size=None, scale_attn_weights=True,
             scale_attn_by_inverse_layer_idx=False)
MOE = True
