"""Qwen2 / Qwen2.5 presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import QWEN_PRESET

_QWEN2 = dict(QWEN_PRESET, family="qwen2", add_qkv_bias=True)

PRESETS = {
    # Qwen2 / Qwen2.5 (Alibaba 2024): Llama + bias on q, k, v; from the released config.json files
    "qwen2-0.5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_attention_heads=14,
                       num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=131072),
    "qwen2.5-0.5b": dict(_QWEN2, hidden_size=896, num_layers=24, num_attention_heads=14,
                         num_query_groups=2, ffn_hidden_size=4864, max_position_embeddings=32768),
}
