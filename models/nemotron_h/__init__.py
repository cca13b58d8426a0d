"""Nemotron-H: Mamba-2, attention and MLP layers in the order of hybrid_override_pattern
(model.py), transformers' config and tensors both ways (hf.py), the published sizes (presets.py)."""
