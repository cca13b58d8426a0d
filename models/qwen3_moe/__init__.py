"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; model_type `qwen3_moe`): a family folder
(models/family_folders.py). Qwen3 attention (per-head q/k RMSNorm, explicit head_dim, no biases)
whose MLPs are routed SwiGLU experts without a shared expert; the MoE conversion is shared with
Qwen2-MoE (models/qwen_moe_like.py)."""
