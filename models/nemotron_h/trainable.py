"""The Nemotron-H model as megazoo's trainable stack: single-mixer layers (models/nemotron_h/
adapter.py; the single-device model with transformers' module names is model.py)."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel

LAYERS = {("mamba2", "none"), ("attention", "none"), ("none", "dense"), ("none", "moe")}


class NemotronHModel(TransformerLanguageModel):
    family = "nemotron_h"

    def __init__(self, config, topo, **kwargs):
        if config.family == self.family:
            layers = set(zip(config.token_mixers or (), config.layer_mlps or ()))
            if config.token_mixers is None or config.layer_mlps is None or layers - LAYERS:
                raise ValueError(f"a Nemotron-H model's layers are (token mixer, MLP) pairs of "
                                 f"{sorted(LAYERS)}; set token_mixers and layer_mlps")
        super().__init__(config, topo, **kwargs)
