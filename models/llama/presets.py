"""Llama and SmolLM2 presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import LLAMA_PRESET

_LLAMA2 = dict(LLAMA_PRESET, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0)
_LLAMA3 = dict(LLAMA_PRESET, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
_SMOLLM2 = dict(LLAMA_PRESET, vocab_size=49152, max_position_embeddings=8192,
                tie_word_embeddings=True)

PRESETS = {
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
}
