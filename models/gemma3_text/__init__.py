"""Gemma 3 text (transformers' `Gemma3ForCausalLM`, model_type `gemma3_text`): a family folder
(models/family_folders.py). Its layers are data for the shared blocks (models/spec.py):
RMSNorm applied as (1 + w) ("rmsnorm_offset"), a norm before and after attention and the MLP
(post_norms), GeGLU with tanh GELU ("geglu_tanh"), q/k norms, embeddings times sqrt(hidden),
softmax scale 1/sqrt(query_pre_attn_scalar), sliding-window layers (5 of 6 by default) with
their own unscaled RoPE base (rope_local_theta) and full layers with rope_theta and the scaling,
and attention/final logit softcapping where the config sets them."""
