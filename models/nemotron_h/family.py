"""What models/registry.py registers for Nemotron-H."""
from __future__ import annotations

from . import adapter
from .trainable import NemotronHModel

MODEL_CLASS = NemotronHModel
ADAPTER = adapter
DEFAULT_PRESET = "nemotron-h-tiny"
