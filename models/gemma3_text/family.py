"""What models/registry.py registers for Gemma 3 text."""
from __future__ import annotations

from . import adapter
from .model import Gemma3TextModel

MODEL_CLASS = Gemma3TextModel
ADAPTER = adapter
DEFAULT_PRESET = "gemma3-tiny"
