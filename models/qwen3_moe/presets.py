"""Qwen3-MoE presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import LLAMA_PRESET

# From the released config.json files: Qwen3's q/k norms and head_dim 128, no shared expert
_QWEN3_MOE = dict(LLAMA_PRESET, family="qwen3_moe", vocab_size=151936,
                  max_position_embeddings=40960, rope_theta=1e6, layernorm_epsilon=1e-6,
                  moe_router_pre_softmax=True, moe_norm_topk_prob=True, moe_aux_loss_coeff=1e-3,
                  qk_layernorm=True)

PRESETS = {
    "qwen3-moe-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, num_layers=48, num_attention_heads=32,
                              num_query_groups=4, kv_channels=128, ffn_hidden_size=6144,
                              num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
}
