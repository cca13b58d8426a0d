"""The Gemma 3 text model: the shared language model built from its layer specs."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class Gemma3TextModel(TransformerLanguageModel):
    family = "gemma3_text"
