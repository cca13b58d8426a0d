"""What models/registry.py registers for Llama."""
from __future__ import annotations

from . import adapter
from .model import LlamaModel

MODEL_CLASS = LlamaModel
ADAPTER = adapter
DEFAULT_PRESET = "smollm2-135m"
