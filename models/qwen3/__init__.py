"""Qwen3 (model_type `qwen3`): a family folder (models/family_folders.py). Llama with an
RMSNorm over head_dim on every query and key head (before the rotary embedding), no QKV bias and
an explicit head_dim (hidden_size need not equal heads x head_dim); the tensors map as Llama's
(models/llama_like.py)."""
