"""The fields a Qwen3.5 text config fixes (models/family_rules.py reads SHAPE and MOE); its
layers are "gated_deltanet" and "gated_attention" token mixers (checked by Qwen35Model)."""
from ..family_bases import QWEN35_LAYERS

SHAPE = dict(QWEN35_LAYERS, layer_mlps=None)
MOE = False
