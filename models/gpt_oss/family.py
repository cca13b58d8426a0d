"""What models/registry.py registers for gpt-oss."""
from __future__ import annotations

from . import adapter
from .model import GptOssModel

MODEL_CLASS = GptOssModel
ADAPTER = adapter
DEFAULT_PRESET = "gpt-oss-tiny"
