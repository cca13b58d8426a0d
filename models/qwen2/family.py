"""What models/registry.py registers for Qwen2."""
from __future__ import annotations

from . import adapter
from .model import Qwen2Model

MODEL_CLASS = Qwen2Model
ADAPTER = adapter
DEFAULT_PRESET = "qwen2.5-0.5b"
