"""The Qwen3.5-MoE text model as megazoo's trainable stack: the shared language model built from
its layer specs, every layer a "gated_deltanet" or "gated_attention" token mixer with a sparse MLP."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel
from ..qwen35_like import check_kinds


class Qwen35MoeModel(TransformerLanguageModel):
    family = "qwen3_5_moe_text"

    def __init__(self, config, topo, **kwargs):
        if config.family == self.family:
            check_kinds(config, "Qwen3.5-MoE")
        super().__init__(config, topo, **kwargs)
