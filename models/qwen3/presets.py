"""Qwen3 presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import QWEN_PRESET

_QWEN3 = dict(QWEN_PRESET, family="qwen3", qk_layernorm=True, max_position_embeddings=40960)

PRESETS = {
    # Qwen3 (Alibaba 2025): Llama + per-head q/k RMSNorm, head_dim 128 whatever the width
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_layers=28, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, ffn_hidden_size=3072),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_layers=28, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, ffn_hidden_size=6144),
    # a Qwen3-shaped toy for smoke tests and CPU demos (not a released model)
    "qwen3-tiny": dict(_QWEN3, hidden_size=128, num_layers=4, num_attention_heads=4,
                       num_query_groups=2, kv_channels=64, ffn_hidden_size=256,
                       max_position_embeddings=2048),
}
