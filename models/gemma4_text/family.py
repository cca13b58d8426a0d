"""What models/registry.py registers for Gemma 4 text."""
from __future__ import annotations

from . import adapter
from .model import Gemma4TextModel

MODEL_CLASS = Gemma4TextModel
ADAPTER = adapter
DEFAULT_PRESET = "gemma4-tiny"
