"""What models/registry.py registers for DeepSeek-V3."""
from __future__ import annotations

from . import adapter
from .model import DeepseekV3Model

MODEL_CLASS = DeepseekV3Model
ADAPTER = adapter
DEFAULT_PRESET = "deepseek-v3-tiny"
