"""Qwen3.5 text presets (`--model NAME`): models/qwen3_5/presets.py's, as TransformerConfig fields."""
from __future__ import annotations

from ..qwen3_5.presets import PRESETS  # noqa: F401 - the family folder's part
