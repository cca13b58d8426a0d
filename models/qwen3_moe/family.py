"""What models/registry.py registers for Qwen3-MoE."""
from __future__ import annotations

from . import adapter
from .model import Qwen3MoeModel

MODEL_CLASS = Qwen3MoeModel
ADAPTER = adapter
DEFAULT_PRESET = "qwen3-moe-30b-a3b"
