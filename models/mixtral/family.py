"""What models/registry.py registers for Mixtral."""
from __future__ import annotations

from . import adapter
from .model import MixtralModel

MODEL_CLASS = MixtralModel
ADAPTER = adapter
DEFAULT_PRESET = "moe-tiny"
