"""The Qwen3-Next model as megazoo's trainable stack: Qwen3.5's layer kinds with MoE MLPs (the
single-device model with transformers' module names is model.py)."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel
from ..qwen35_like import check_kinds


class Qwen3NextModel(TransformerLanguageModel):
    family = "qwen3_next"

    def __init__(self, config, topo, **kwargs):
        if config.family == self.family:
            check_kinds(config, "Qwen3-Next")
        super().__init__(config, topo, **kwargs)
