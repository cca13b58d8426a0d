"""Gemma 4 text (transformers' `Gemma4ForCausalLM`, model_type `gemma4_text`): a family folder
(models/family_folders.py). Its layers are Gemma 3's (sandwich norms, GeGLU with tanh GELU, q/k
norms, embeddings times sqrt(hidden), sliding/full layers with two RoPE bases, final logit
softcapping) with plain RMSNorm (x / rms(x) * w), softmax scale 1, a weightless RMSNorm on each
value head (value_norm), a learned per-layer scalar on each layer's output (layer_scalar) and
the full layers' "proportional" RoPE (models/rope.py). What it does not model is refused by
its adapter in one line naming the config field."""
