"""Field sets that several family folders share (data only; imports nothing).

A family folder's rules.py (SHAPE: the config fields the family fixes) and presets.py (PRESETS)
start from these where families share a shape, so each shared shape is written once: the
Llama-shaped families' rotary positions, RMSNorm and SwiGLU, the layer options newer families
brought (which the classic families refuse at anything but their default), the softmax router.
"""

# ---- rules (models/<family>/rules.py SHAPE) --------------------------------------------------

# rotary positions, RMSNorm, SwiGLU: the Llama-shaped families
ROPE = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu",
            embedding_layernorm=False)
# attention without a sliding window
FULL = dict(sliding_window=None)
# The layer options newer families brought (models/spec.py), at their defaults: the families
# before them refuse each.
# Gemma 4's newer options (models/gemma4_text/), off: the other families refuse each
GEMMA4_OFF = dict(global_num_query_groups=None, attention_k_eq_v=False, kv_shared_layers=0,
                  kv_shared_double_mlp=False, moe_router_input_norm=False,
                  moe_per_expert_scale=False, moe_with_dense_mlp=False)
CLASSIC = dict(GEMMA4_OFF, rope_local_theta=None, post_norms=False, embedding_scale=False,
               query_pre_attn_scalar=None, attn_logit_softcapping=None,
               final_logit_softcapping=None, attention_sinks=False, value_norm=False,
               layer_scalar=False, global_kv_channels=None, swiglu_alpha=1.702,
               swiglu_limit=None, token_mixers=None)
# no multi-head latent attention, no multi-token prediction (DeepSeek-V3 has both)
MHA = dict(CLASSIC, kv_lora_rank=None, mtp_num_layers=0)
# a softmax router without DeepSeek-V3's expert bias, groups, scaling or dense first layers
SOFTMAX_ROUTER = dict(MHA, moe_router_score_function="softmax", moe_router_bias=False,
                      moe_router_enable_expert_bias=False, moe_router_num_groups=None,
                      moe_router_topk_scaling_factor=None, moe_first_dense_layers=0)

# Qwen3.5's layers (Gated DeltaNet and gated attention), shared by Qwen3.5 text and Qwen3-Next
QWEN35_LAYERS = dict(position_embedding="rope", normalization="rmsnorm_offset", activation="swiglu",
                     embedding_layernorm=False, post_norms=False, embedding_scale=False,
                     qk_layernorm=True, bias=False, add_qkv_bias=False, attention_sinks=False,
                     kv_lora_rank=None, mtp_num_layers=0, sliding_window=None,
                     rope_local_theta=None, query_pre_attn_scalar=None,
                     attn_logit_softcapping=None, final_logit_softcapping=None,
                     scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                     rope_scaling=None, mamba_num_heads=None, value_norm=False,
                     layer_scalar=False, global_kv_channels=None, **GEMMA4_OFF)

# ---- presets (models/<family>/presets.py PRESETS) --------------------------------------------

# the fields every Llama-shaped preset sets (each names its family on top)
LLAMA_PRESET = dict(family="llama", position_embedding="rope", normalization="rmsnorm",
                    activation="swiglu", bias=False, tie_word_embeddings=False,
                    layernorm_epsilon=1e-5)
# Qwen2 and Qwen3's shared vocabulary, RoPE base, eps and tied embeddings
QWEN_PRESET = dict(LLAMA_PRESET, vocab_size=151936, rope_theta=1000000.0, layernorm_epsilon=1e-6,
                   tie_word_embeddings=True)
