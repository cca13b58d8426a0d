"""What models/registry.py registers for Mistral."""
from __future__ import annotations

from . import adapter
from .model import MistralModel

MODEL_CLASS = MistralModel
ADAPTER = adapter
DEFAULT_PRESET = "mistral-tiny"
