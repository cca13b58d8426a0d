"""Mixtral presets and the tiny MoE (`--model NAME`): field values for `TransformerConfig`, each
naming its family."""
from ..family_bases import LLAMA_PRESET

# Mixtral (Jiang et al. 2024) from its released config.json files; the aux-loss coefficient as
# Megatron-LM's recipes (megazoo's aux loss is Megatron's: HF's router_aux_loss_coef multiplies a
# sum that is topk times larger)
_MIXTRAL = dict(LLAMA_PRESET, family="mixtral", vocab_size=32000, max_position_embeddings=32768,
                rope_theta=1e6, num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2)

PRESETS = {
    # Mixture of experts (docs/moe.md)
    "mixtral-8x7b": dict(_MIXTRAL, hidden_size=4096, num_layers=32, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=14336),
    "mixtral-8x22b": dict(_MIXTRAL, vocab_size=32768, max_position_embeddings=65536,
                          hidden_size=6144, num_layers=56, num_attention_heads=48,
                          num_query_groups=8, ffn_hidden_size=16384),
    # A small MoE for CPUs, tests and the demo: 8 experts, top-2, z-loss.
    "moe-tiny": dict(LLAMA_PRESET, family="mixtral", vocab_size=32000, max_position_embeddings=1024,
                     hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=256, num_experts=8, moe_router_topk=2,
                     moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
}
