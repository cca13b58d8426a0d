"""What models/registry.py registers for GPT-2."""
from __future__ import annotations

from . import adapter
from .model import GPTModel

MODEL_CLASS = GPTModel
ADAPTER = adapter
DEFAULT_PRESET = None  # train_gpt.py: the flags give the shape
