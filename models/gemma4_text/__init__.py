"""Gemma 4 text (transformers' `Gemma4ForCausalLM`, model_type `gemma4_text`): a family folder
(models/family_folders.py). Its layers are Gemma 3's (sandwich norms, GeGLU with tanh GELU, q/k
norms, embeddings times sqrt(hidden), sliding/full layers with two RoPE bases, final logit
softcapping) with plain RMSNorm (x / rms(x) * w), softmax scale 1, a weightless RMSNorm on each
value head (value_norm), a learned per-layer scalar on each layer's output (layer_scalar), the full
layers' "proportional" RoPE (models/rope.py), their own head size and, with attention_k_eq_v,
key/value heads with values taken from the key projection, and the 26B-A4B's MoE block (a dense
MLP and routed experts side by side, MLP kind "dense_moe"), KV sharing (the last layers
attending with earlier layers' keys and values, models/kv_sharing.py) and per-layer inputs
(models/per_layer_inputs.py). What it does not model is refused by
its adapter in one line naming the config field."""
