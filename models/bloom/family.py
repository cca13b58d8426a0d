"""What models/registry.py registers for BLOOM."""
from __future__ import annotations

from . import adapter
from .model import BloomModel

MODEL_CLASS = BloomModel
ADAPTER = adapter
DEFAULT_PRESET = "bloom-560m"
