"""The fields a Qwen3-Next config fixes (models/family_rules.py reads SHAPE and MOE): Qwen3.5's
layers with a softmax-router mixture of experts and a gated shared expert."""

SHAPE = dict(position_embedding="rope", normalization="rmsnorm_offset", activation="swiglu",
             embedding_layernorm=False, post_norms=False, value_norm=False, layer_scalar=False, global_kv_channels=None, embedding_scale=False, qk_layernorm=True,
             bias=False, add_qkv_bias=False, attention_sinks=False, kv_lora_rank=None,
             mtp_num_layers=0, sliding_window=None, rope_local_theta=None,
             query_pre_attn_scalar=None, attn_logit_softcapping=None,
             final_logit_softcapping=None, scale_attn_weights=True,
             scale_attn_by_inverse_layer_idx=False, rope_scaling=None, mamba_num_heads=None,
             moe_router_score_function="softmax", moe_router_pre_softmax=True,
             moe_router_bias=False, moe_router_enable_expert_bias=False,
             moe_router_num_groups=None, moe_router_topk_scaling_factor=None,
             moe_shared_expert_gate=True)
MOE = True
