"""Qwen2-MoE presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import LLAMA_PRESET

# From the released config.json files; aux-loss coefficient as Megatron-LM's recipes. Qwen2-MoE
# biases q, k and v (add_qkv_bias).
_QWEN2_MOE = dict(LLAMA_PRESET, family="qwen2_moe", vocab_size=151936, max_position_embeddings=8192,
                  rope_theta=1e6, layernorm_epsilon=1e-6, moe_router_pre_softmax=True,
                  moe_aux_loss_coeff=1e-3, moe_shared_expert_gate=True, add_qkv_bias=True)

PRESETS = {
    "qwen2-moe-a2.7b": dict(_QWEN2_MOE, hidden_size=2048, num_layers=24, num_attention_heads=16,
                            ffn_hidden_size=5632, num_experts=60, moe_router_topk=4,
                            moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=5632),
    "qwen2-moe-57b-a14b": dict(_QWEN2_MOE, max_position_embeddings=32768, hidden_size=3584,
                               num_layers=28, num_attention_heads=28, num_query_groups=4,
                               ffn_hidden_size=18944, num_experts=64, moe_router_topk=8,
                               moe_ffn_hidden_size=2560, moe_shared_expert_intermediate_size=20480),
}
