"""The fields a Gemma 4 text config fixes (models/family_rules.py reads SHAPE and MOE)."""

SHAPE = dict(position_embedding="rope", normalization="rmsnorm", activation="geglu_tanh",
             embedding_layernorm=False, post_norms=True, embedding_scale=True, qk_layernorm=True,
             value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0,
             bias=False, add_qkv_bias=False, attention_sinks=False, kv_lora_rank=None,
             mtp_num_layers=0, token_mixers=None, attn_logit_softcapping=None,
             scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)
MOE = "mixed"  # dense, or (enable_moe_block) a dense MLP and experts in every layer
