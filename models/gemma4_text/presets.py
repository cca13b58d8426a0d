"""Gemma 4 text presets (`--model NAME`). No released Gemma 4 text shape is among them yet (they
import from their config.json, models/gemma4_text/adapter.py)."""

_GEMMA4 = dict(family="gemma4_text", position_embedding="rope", normalization="rmsnorm",
               activation="geglu_tanh", post_norms=True, embedding_scale=True, qk_layernorm=True,
               value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0, bias=False,
               tie_word_embeddings=True, layernorm_epsilon=1e-6)

PRESETS = {
    # a tiny Gemma 4 for CPUs and tests: a sliding layer, then a full one with proportional RoPE
    # and its own (larger) head size
    "gemma4-tiny": dict(_GEMMA4, vocab_size=1024, hidden_size=64, num_layers=2,
                        num_attention_heads=4, num_query_groups=2, kv_channels=16,
                        ffn_hidden_size=128, max_position_embeddings=1024, rope_theta=1e6,
                        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                        rope_local_theta=1e4, sliding_window=4, full_attention_layers=(1,),
                        global_kv_channels=32),
}
