"""The Qwen3.5 text model as megazoo's trainable stack: the shared language model built from its
layer specs, every layer a "gated_deltanet" or "gated_attention" token mixer with a SwiGLU MLP
(the single-device model with transformers' module names is model.py)."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel
from ..qwen35_like import check_kinds


class Qwen35Model(TransformerLanguageModel):
    family = "qwen3_5_text"

    def __init__(self, config, topo, **kwargs):
        if config.family == self.family:
            check_kinds(config, "Qwen3.5")
        super().__init__(config, topo, **kwargs)
