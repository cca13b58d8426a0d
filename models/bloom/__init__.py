"""BLOOM (model_type `bloom`): a family folder (models/family_folders.py). ALiBi attention,
LayerNorm on the word embeddings, tanh-GELU, tied (or untied) embeddings; the Hugging Face
adapter maps `BloomForCausalLM`."""
