"""Named model presets (`--model NAME`): published shapes and tiny test models, each naming its
family (models/registry.py). A preset is data: field values for `TransformerConfig`; flags
override them field by field."""
from __future__ import annotations

from .config import TransformerConfig
from .family_folders import load

_GPT = dict(family="gpt2", vocab_size=50257, position_embedding="learned", activation="gelu_tanh")
_MEGATRON_GPT = dict(_GPT, max_position_embeddings=2048)
_BLOOM = dict(family="bloom", vocab_size=250880, position_embedding="alibi", activation="gelu_tanh",
              embedding_layernorm=True, max_position_embeddings=2048)
_LLAMA = dict(family="llama", position_embedding="rope", normalization="rmsnorm",
              activation="swiglu", bias=False, tie_word_embeddings=False, layernorm_epsilon=1e-5)
_LLAMA2 = dict(_LLAMA, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
_SMOLLM2 = dict(_LLAMA, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
_QWEN = dict(_LLAMA, vocab_size=151936, rope_theta=1000000.0, layernorm_epsilon=1e-6,
             tie_word_embeddings=True)
_QWEN2 = dict(_QWEN, family="qwen2", add_qkv_bias=True)
_QWEN3 = dict(_QWEN, family="qwen3", qk_layernorm=True, max_position_embeddings=40960)
# Mistral (Jiang et al. 2023): Llama with a 4096-token sliding window in every layer
_MISTRAL = dict(_LLAMA, family="mistral", vocab_size=32000, max_position_embeddings=32768)

# Mixture of experts. Mixtral (Jiang et al. 2024) and Qwen-MoE from their released config.json
# files; aux-loss coefficients as Megatron-LM's recipes (megazoo's aux loss is Megatron's: HF's
# router_aux_loss_coef multiplies a sum that is topk times larger). Qwen2-MoE biases q, k and v
# (add_qkv_bias); Qwen3-MoE has Qwen3's q/k norms and head_dim 128, no shared expert.
_MIXTRAL = dict(_LLAMA, family="mixtral", vocab_size=32000, max_position_embeddings=32768,
                rope_theta=1e6, num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2)
_QWEN2_MOE = dict(_LLAMA, family="qwen2_moe", vocab_size=151936, max_position_embeddings=8192,
                  rope_theta=1e6, layernorm_epsilon=1e-6, moe_router_pre_softmax=True,
                  moe_aux_loss_coeff=1e-3, moe_shared_expert_gate=True, add_qkv_bias=True)
_QWEN3_MOE = dict(_LLAMA, family="qwen3_moe", vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1e6, layernorm_epsilon=1e-6, moe_router_pre_softmax=True,
                  moe_norm_topk_prob=True, moe_aux_loss_coeff=1e-3, qk_layernorm=True)
# DeepSeek-V3's training recipe: the bias update 1e-3, the sequence-wise aux loss 1e-4
_DEEPSEEK_V3 = dict(_LLAMA, family="deepseek_v3", layernorm_epsilon=1e-6,
                    tie_word_embeddings=False, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=1e-3, moe_norm_topk_prob=True,
                    moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
                    moe_aux_loss_coeff=1e-4)

PRESETS: dict[str, dict] = {
    # GPT-2 (Radford et al. 2019)
    "gpt2": dict(_GPT, hidden_size=768, num_layers=12, num_attention_heads=12),
    "gpt2-medium": dict(_GPT, hidden_size=1024, num_layers=24, num_attention_heads=16),
    "gpt2-large": dict(_GPT, hidden_size=1280, num_layers=36, num_attention_heads=20),
    "gpt2-xl": dict(_GPT, hidden_size=1600, num_layers=48, num_attention_heads=25),
    # Megatron-LM / GPT-3 family shapes (Brown et al. 2020, Narayanan et al. 2021)
    "gpt-1.3b": dict(_MEGATRON_GPT, hidden_size=2048, num_layers=24, num_attention_heads=16),
    "gpt-2.7b": dict(_MEGATRON_GPT, hidden_size=2560, num_layers=32, num_attention_heads=32),
    "gpt-6.7b": dict(_MEGATRON_GPT, hidden_size=4096, num_layers=32, num_attention_heads=32),
    "gpt-13b": dict(_MEGATRON_GPT, hidden_size=5120, num_layers=40, num_attention_heads=40),
    "gpt-39b": dict(_MEGATRON_GPT, hidden_size=8192, num_layers=48, num_attention_heads=64),
    "gpt-175b": dict(_MEGATRON_GPT, hidden_size=12288, num_layers=96, num_attention_heads=96),
    # BLOOM (BigScience 2022)
    "bloom-560m": dict(_BLOOM, hidden_size=1024, num_layers=24, num_attention_heads=16),
    "bloom-1b1": dict(_BLOOM, hidden_size=1536, num_layers=24, num_attention_heads=16),
    "bloom-1b7": dict(_BLOOM, hidden_size=2048, num_layers=24, num_attention_heads=16),
    "bloom-3b": dict(_BLOOM, hidden_size=2560, num_layers=30, num_attention_heads=32),
    "bloom-7b1": dict(_BLOOM, hidden_size=4096, num_layers=30, num_attention_heads=32),
    "bloom-176b": dict(_BLOOM, hidden_size=14336, num_layers=70, num_attention_heads=112),
    # SmolLM2 (Hugging Face 2024), from the released config.json files
    "smollm2-135m": dict(_SMOLLM2, hidden_size=576, num_layers=30, num_attention_heads=9,
                         num_query_groups=3, ffn_hidden_size=1536, rope_theta=100000.0),
    "smollm2-360m": dict(_SMOLLM2, hidden_size=960, num_layers=32, num_attention_heads=15,
                         num_query_groups=5, ffn_hidden_size=2560, rope_theta=100000.0),
    "smollm2-1.7b": dict(_SMOLLM2, hidden_size=2048, num_layers=24, num_attention_heads=32,
                         num_query_groups=32, ffn_hidden_size=8192, rope_theta=130000.0),
    # Llama 2 (Touvron et al. 2023); only 70B uses grouped-query attention
    "llama2-7b": dict(_LLAMA2, hidden_size=4096, num_layers=32, num_attention_heads=32,
                      ffn_hidden_size=11008),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, num_layers=40, num_attention_heads=40,
                       ffn_hidden_size=13824),
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, num_layers=80, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672),
    # Llama 3 (Meta 2024): 128K vocabulary, GQA with 8 KV heads at every size
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, num_layers=32, num_attention_heads=32,
                      num_query_groups=8, ffn_hidden_size=14336),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, num_layers=80, num_attention_heads=64,
                       num_query_groups=8, ffn_hidden_size=28672),
    "llama3-405b": dict(_LLAMA3, hidden_size=16384, num_layers=126, num_attention_heads=128,
                        num_query_groups=8, ffn_hidden_size=53248),
    # Qwen2 / Qwen2.5 (Alibaba 2024): Llama + bias on q, k, v; from the released config.json files
    "qwen2-0.5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_attention_heads=14,
                       num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=131072),
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_attention_heads=14,
                         num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=32768),
    # Qwen3 (Alibaba 2025): Llama + per-head q/k RMSNorm, head_dim 128 whatever the width
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_layers=28, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, ffn_hidden_size=3072),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_layers=28, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, ffn_hidden_size=6144),
    # a Qwen3-shaped toy for smoke tests and CPU demos (not a released model)
    "qwen3-tiny": dict(_QWEN3, hidden_size=128, num_layers=4, num_attention_heads=4,
                       num_query_groups=2, kv_channels=64, ffn_hidden_size=256,
                       max_position_embeddings=2048),
    # Mistral 7B v0.1, from its released config.json
    "mistral-7b": dict(_MISTRAL, hidden_size=4096, num_layers=32, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, sliding_window=4096),
    # a Mistral-shaped toy for smoke tests and CPU demos (not a released model)
    "mistral-tiny": dict(_MISTRAL, hidden_size=128, num_layers=4, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=256, max_position_embeddings=2048,
                         sliding_window=8),
    # Mixture of experts (docs/moe.md)
    "mixtral-8x7b": dict(_MIXTRAL, hidden_size=4096, num_layers=32, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=14336),
    "mixtral-8x22b": dict(_MIXTRAL, vocab_size=32768, max_position_embeddings=65536,
                          hidden_size=6144, num_layers=56, num_attention_heads=48,
                          num_query_groups=8, ffn_hidden_size=16384),
    "qwen2-moe-a2.7b": dict(_QWEN2_MOE, hidden_size=2048, num_layers=24, num_attention_heads=16,
                            ffn_hidden_size=5632, num_experts=60, moe_router_topk=4,
                            moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=5632),
    "qwen2-moe-57b-a14b": dict(_QWEN2_MOE, max_position_embeddings=32768, hidden_size=3584,
                               num_layers=28, num_attention_heads=28, num_query_groups=4,
                               ffn_hidden_size=18944, num_experts=64, moe_router_topk=8,
                               moe_ffn_hidden_size=2560, moe_shared_expert_intermediate_size=20480),
    "qwen3-moe-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, num_layers=48, num_attention_heads=32,
                              num_query_groups=4, kv_channels=128, ffn_hidden_size=6144,
                              num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
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
    # A small MoE for CPUs, tests and the demo: 8 experts, top-2, z-loss.
    "moe-tiny": dict(_LLAMA, family="mixtral", vocab_size=32000, max_position_embeddings=1024,
                     hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=256, num_experts=8, moe_router_topk=2,
                     moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
}
# the family folders' presets (models/<family>/presets.py)
for _folder in load("presets").values():
    PRESETS.update(_folder.PRESETS)


def preset(name: str, **overrides) -> TransformerConfig:
    """A named preset; keyword overrides win (as individual flags do over --model)."""
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is not a known preset; choose one of {sorted(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})
