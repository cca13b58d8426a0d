"""GPT (GPT-2 architecture, Megatron's GPT; model_type `gpt2`): a family folder
(models/family_folders.py). Learned positions, pre-LayerNorm, tanh-GELU, tied (or untied)
embeddings; the Hugging Face adapter maps `GPT2LMHeadModel`."""
