"""The Gemma 4 text model: the shared language model built from its layer specs."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class Gemma4TextModel(TransformerLanguageModel):
    family = "gemma4_text"
