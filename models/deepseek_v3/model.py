"""The DeepSeek-V3 model: the shared blocks with multi-head latent attention, built as its config
says (models/family_rules.py checks what the config holds)."""
from __future__ import annotations

from megazoo.parallel.topology import ParallelTopology

from ..config import TransformerConfig
from ..language_model import TransformerLanguageModel


class DeepseekV3Model(TransformerLanguageModel):
    family = "deepseek_v3"

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, **kwargs):
        if not config.kv_lora_rank:
            raise ValueError("DeepseekV3Model needs multi-latent attention (--kv-lora-rank)")
        super().__init__(config, topo, **kwargs)
