"""The DeepSeek-V3 model: the shared blocks with multi-head latent attention, built as its config
says (models/family_rules.py checks what the config holds). Without --kv-lora-rank the layers
take ordinary (grouped-query) attention: DeepSeek-V3's MoE layers under Megatron-core's GQA
attention, as Megatron-LM trains them; such a model has no Hugging Face form (the adapter's
export refuses it)."""
from __future__ import annotations

from megazoo.parallel.topology import ParallelTopology

from ..config import TransformerConfig
from ..language_model import TransformerLanguageModel


class DeepseekV3Model(TransformerLanguageModel):
    family = "deepseek_v3"

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, **kwargs):
        super().__init__(config, topo, **kwargs)
