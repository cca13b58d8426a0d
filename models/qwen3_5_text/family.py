"""What models/registry.py registers for Qwen3.5 text."""
from __future__ import annotations

from . import adapter
from .trainable import Qwen35Model

MODEL_CLASS = Qwen35Model
ADAPTER = adapter
DEFAULT_PRESET = "qwen3.5-tiny"
