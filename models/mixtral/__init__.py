"""Mixtral (Jiang et al. 2024; model_type `mixtral`): a family folder
(models/family_folders.py). Llama blocks whose MLPs are routed SwiGLU experts (8, top-2 in the
released models); the Hugging Face adapter maps `MixtralForCausalLM`."""
