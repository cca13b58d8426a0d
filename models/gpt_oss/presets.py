"""gpt-oss presets (`--model NAME`)."""

_GPT_OSS = dict(family="gpt_oss", position_embedding="rope", normalization="rmsnorm",
                activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0, bias=True,
                attention_sinks=True, moe_router_bias=True, tie_word_embeddings=False,
                layernorm_epsilon=1e-5, rope_theta=150000.0,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 4096})

PRESETS = {
    # openai/gpt-oss-20b: 24 layers alternating sliding (128) and full, 32 experts, top-4
    "gpt-oss-20b": dict(_GPT_OSS, vocab_size=201088, hidden_size=2880, num_layers=24,
                        num_attention_heads=64, num_query_groups=8, kv_channels=64,
                        ffn_hidden_size=2880, max_position_embeddings=131072, sliding_window=128,
                        full_attention_layers=tuple(range(1, 24, 2)), num_experts=32,
                        moe_router_topk=4, moe_aux_loss_coeff=1e-3),
    # a tiny gpt-oss for CPUs and tests: a sliding layer, then a full one
    "gpt-oss-tiny": dict(_GPT_OSS, vocab_size=1024, hidden_size=64, num_layers=2,
                         num_attention_heads=4, num_query_groups=2, kv_channels=16,
                         ffn_hidden_size=64, max_position_embeddings=1024, sliding_window=4,
                         full_attention_layers=(1,), num_experts=4, moe_router_topk=2),
}
