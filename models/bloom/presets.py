"""BLOOM presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
_BLOOM = dict(family="bloom", vocab_size=250880, position_embedding="alibi", activation="gelu_tanh",
              embedding_layernorm=True, max_position_embeddings=2048)

PRESETS = {
    # BLOOM (BigScience 2022)
    "bloom-560m": dict(_BLOOM, hidden_size=1024, num_layers=24, num_attention_heads=16),
    "bloom-1b1": dict(_BLOOM, hidden_size=1536, num_layers=24, num_attention_heads=16),
    "bloom-1b7": dict(_BLOOM, hidden_size=2048, num_layers=24, num_attention_heads=16),
    "bloom-3b": dict(_BLOOM, hidden_size=2560, num_layers=30, num_attention_heads=32),
    "bloom-7b1": dict(_BLOOM, hidden_size=4096, num_layers=30, num_attention_heads=32),
    "bloom-176b": dict(_BLOOM, hidden_size=14336, num_layers=70, num_attention_heads=112),
}
