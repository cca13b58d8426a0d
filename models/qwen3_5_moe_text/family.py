"""What models/registry.py registers for Qwen3.5-MoE text."""
from __future__ import annotations

from . import adapter
from .trainable import Qwen35MoeModel

MODEL_CLASS = Qwen35MoeModel
ADAPTER = adapter
DEFAULT_PRESET = "qwen3.5-moe-tiny"
