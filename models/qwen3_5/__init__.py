"""Qwen3.5 text: Gated DeltaNet and gated-attention layers (model.py), transformers' config and
tensors both ways (hf.py), the published sizes (presets.py)."""
