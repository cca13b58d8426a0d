"""Mistral presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
from ..family_bases import LLAMA_PRESET

# Mistral (Jiang et al. 2023): Llama with a 4096-token sliding window in every layer
_MISTRAL = dict(LLAMA_PRESET, family="mistral", vocab_size=32000, max_position_embeddings=32768)

PRESETS = {
    # Mistral 7B v0.1, from its released config.json
    "mistral-7b": dict(_MISTRAL, hidden_size=4096, num_layers=32, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, sliding_window=4096),
    # a Mistral-shaped toy for smoke tests and CPU demos (not a released model)
    "mistral-tiny": dict(_MISTRAL, hidden_size=128, num_layers=4, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=256, max_position_embeddings=2048,
                         sliding_window=8),
}
