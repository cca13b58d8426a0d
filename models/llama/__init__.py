"""Llama (Llama 2/3, SmolLM2, ...; model_type `llama`): a family folder
(models/family_folders.py). Rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied
(or tied) embeddings; the Hugging Face adapter maps `LlamaForCausalLM` with the conversion the
Llama-shaped families share (models/llama_like.py)."""
