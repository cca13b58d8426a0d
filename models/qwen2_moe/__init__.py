"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; model_type `qwen2_moe`): a family folder
(models/family_folders.py). Qwen2 attention (q, k, v biased) whose MLPs are routed SwiGLU
experts plus a shared expert gated by sigmoid(x . g); the MoE conversion is shared with
Qwen3-MoE (models/qwen_moe_like.py)."""
