"""The gpt-oss model: the shared language model built from its layer specs."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class GptOssModel(TransformerLanguageModel):
    def __init__(self, config, topo, **kwargs):
        if config.family != "gpt_oss":
            raise ValueError(f"GptOssModel needs a 'gpt_oss' config; this one is family "
                             f"{config.family!r} (models/registry.py build_model builds it)")
        super().__init__(config, topo, **kwargs)
