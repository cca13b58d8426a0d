"""GPT-2 and Megatron-LM GPT presets (`--model NAME`): field values for `TransformerConfig`, each naming its
family."""
_GPT = dict(family="gpt2", vocab_size=50257, position_embedding="learned", activation="gelu_tanh")
_MEGATRON_GPT = dict(_GPT, max_position_embeddings=2048)

PRESETS = {
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
}
