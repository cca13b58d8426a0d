"""The gpt-oss model: the shared language model built from its layer specs."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class GptOssModel(TransformerLanguageModel):
    family = "gpt_oss"
