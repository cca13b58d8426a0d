"""Qwen3-Next: Qwen3.5's layers with sparse mixture-of-experts MLPs (model.py), transformers'
config and tensors both ways, the fused linear-layer projections split and re-fused (hf.py)."""
