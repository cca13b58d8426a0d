"""What models/registry.py registers for Qwen2-MoE."""
from __future__ import annotations

from . import adapter
from .model import Qwen2MoeModel

MODEL_CLASS = Qwen2MoeModel
ADAPTER = adapter
DEFAULT_PRESET = "qwen2-moe-a2.7b"
