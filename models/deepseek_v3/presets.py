"""DeepSeek-V3 presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import LLAMA_PRESET

# DeepSeek-V3's training recipe: the bias update 1e-3, the sequence-wise aux loss 1e-4
_DEEPSEEK_V3 = dict(LLAMA_PRESET, family="deepseek_v3", layernorm_epsilon=1e-6,
                    tie_word_embeddings=False, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                    moe_norm_topk_prob=True, moe_router_topk_scaling_factor=2.5,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)

PRESETS = {
    # DeepSeek-V3 (arXiv 2412.19437; docs/deepseek.md): MLA, 3 dense layers, 256 experts top-8 in
    # 8 groups (4 per token) + a shared one, the expert bias, one multi-token prediction depth
    # (pre-training's 4096 positions, before the YaRN extension to 128K: models/mla.py models
    # YaRN when a rope_scaling is given)
    "deepseek-v3": dict(_DEEPSEEK_V3, vocab_size=129280, max_position_embeddings=4096,
                        hidden_size=7168, num_layers=61, num_attention_heads=128,
                        ffn_hidden_size=18432, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                        moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
                        moe_router_group_topk=4, moe_first_dense_layers=3, mtp_num_layers=1),
    # a DeepSeek-V3-shaped toy for CPUs and tests (not a released model)
    "deepseek-v3-tiny": dict(_DEEPSEEK_V3, vocab_size=32000, max_position_embeddings=1024,
                             hidden_size=128, num_layers=4, num_attention_heads=4,
                             ffn_hidden_size=256, q_lora_rank=48, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64,
                             moe_shared_expert_intermediate_size=64, moe_router_num_groups=4,
                             moe_router_group_topk=2, moe_first_dense_layers=1),
}
