"""Qwen3.5-MoE text (model_type `qwen3_5_moe_text`, transformers' `Qwen3_5MoeForCausalLM`; the
released Qwen3.5-35B-A3B is its vision-language wrapper, model_type `qwen3_5_moe`): Qwen3.5's
layers ("gated_deltanet" and "gated_attention" token mixers, zero-centred RMSNorms, Qwen3.5's
tensor names) with Qwen3-Next's sparse MLP on every layer (softmax router, top-k always
renormalised, SwiGLU experts, a shared expert scaled by sigmoid of its gate)."""
