"""Mistral (Jiang et al. 2023; model_type `mistral`): a family folder
(models/family_folders.py). Llama blocks (no biases, grouped-query attention, an explicit
head_dim allowed) with sliding-window attention in every layer; the tensors map as Llama's
(models/llama_like.py)."""
