"""The fields a Nemotron-H config fixes (models/family_rules.py reads SHAPE and MOE); its layers
are single mixers: "mamba2" or "attention" without MLP, or a squared-ReLU MLP or MoE MLP alone."""

from ..family_bases import GEMMA4_OFF

SHAPE = dict(GEMMA4_OFF, position_embedding="none", normalization="rmsnorm", activation="relu2",
             embedding_layernorm=False, post_norms=False, value_norm=False, layer_scalar=False, global_kv_channels=None,
             embedding_scale=False,
             qk_layernorm=False, bias=False, add_qkv_bias=False, attention_sinks=False,
             kv_lora_rank=None, mtp_num_layers=0, sliding_window=None, rope_local_theta=None,
             query_pre_attn_scalar=None, attn_logit_softcapping=None,
             final_logit_softcapping=None, scale_attn_weights=True,
             scale_attn_by_inverse_layer_idx=False, linear_num_key_heads=None,
             rotary_fraction=1.0)
MOE = "mixed"  # dense or MoE per layer (layers_block_type "moe")
