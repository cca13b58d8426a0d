"""Qwen2 / Qwen2.5 (model_type `qwen2`): a family folder (models/family_folders.py). Llama
with a bias on the q, k and v projections (none on o_proj or the MLP); the tensors map as
Llama's (models/llama_like.py)."""
