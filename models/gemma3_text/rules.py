"""The fields a Gemma 3 text config fixes (models/family_rules.py reads SHAPE and MOE)."""

from ..family_bases import GEMMA4_OFF

SHAPE = dict(GEMMA4_OFF, position_embedding="rope", normalization="rmsnorm_offset", activation="geglu_tanh",
             embedding_layernorm=False, post_norms=True, value_norm=False, layer_scalar=False, global_kv_channels=None,
             embedding_scale=True, qk_layernorm=True,
             bias=False, add_qkv_bias=False, attention_sinks=False, kv_lora_rank=None,
             mtp_num_layers=0, token_mixers=None, attn_logit_softcapping=None, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)
MOE = False
