"""Gemma 3 text presets (`--model NAME`)."""

_GEMMA3 = dict(family="gemma3_text", position_embedding="rope", normalization="rmsnorm_offset",
               activation="geglu_tanh", post_norms=True, embedding_scale=True, qk_layernorm=True,
               bias=False, tie_word_embeddings=True, layernorm_epsilon=1e-6)

PRESETS = {
    # google/gemma-3-1b-pt's text shape: 26 layers, 5 sliding (512) to 1 full
    "gemma3-1b": dict(_GEMMA3, vocab_size=262144, hidden_size=1152, num_layers=26,
                      num_attention_heads=4, num_query_groups=1, kv_channels=256,
                      ffn_hidden_size=6912, max_position_embeddings=32768, rope_theta=1e6,
                      rope_local_theta=1e4, sliding_window=512, query_pre_attn_scalar=256,
                      full_attention_layers=(5, 11, 17, 23)),
    # a tiny Gemma 3 for CPUs and tests: a sliding layer, then a full one
    "gemma3-tiny": dict(_GEMMA3, vocab_size=1024, hidden_size=64, num_layers=2,
                        num_attention_heads=4, num_query_groups=2, kv_channels=16,
                        ffn_hidden_size=128, max_position_embeddings=1024, rope_theta=1e6,
                        rope_local_theta=1e4, sliding_window=4, query_pre_attn_scalar=16,
                        full_attention_layers=(1,)),
}
