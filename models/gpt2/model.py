"""The GPT-2 model: the shared blocks, built as its config says (models/family_rules.py
checks what the config holds)."""
from __future__ import annotations

from ..language_model import TransformerLanguageModel


class GPTModel(TransformerLanguageModel):
    family = "gpt2"
