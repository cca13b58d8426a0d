"""What models/registry.py registers for Qwen3-Next."""
from __future__ import annotations

from . import adapter
from .trainable import Qwen3NextModel

MODEL_CLASS = Qwen3NextModel
ADAPTER = adapter
DEFAULT_PRESET = "qwen3-next-tiny"
