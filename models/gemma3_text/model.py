"""The Gemma 3 text model: the shared language model built from its layer specs."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class Gemma3TextModel(TransformerLanguageModel):
    def __init__(self, config, topo, **kwargs):
        if config.family != "gemma3_text":
            raise ValueError(f"Gemma3TextModel needs a 'gemma3_text' config; this one is family "
                             f"{config.family!r} (models/registry.py build_model builds it)")
        super().__init__(config, topo, **kwargs)
