"""What models/registry.py registers for Qwen3."""
from __future__ import annotations

from . import adapter
from .model import Qwen3Model

MODEL_CLASS = Qwen3Model
ADAPTER = adapter
DEFAULT_PRESET = "qwen3-tiny"
