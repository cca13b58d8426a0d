"""Hugging Face model families megazoo converts, keyed by the HF `config.json` `model_type`.

Each value is a module providing `config_from_hf(hf_config)`, `hf_config(config)`,
`from_hf_state_dict(sd, config)`, `to_hf_state_dict(full, config)` and one
`TransformerLanguageModel` subclass (found by `model_class`). Add a family with one entry.
"""
from __future__ import annotations

from . import bloom, deepseek_v3, gpt, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from .language_model import TransformerLanguageModel

FAMILIES = {"gpt2": gpt, "bloom": bloom, "llama": llama, "qwen2": qwen2, "qwen3": qwen3,
            "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe,
            "deepseek_v3": deepseek_v3}


def model_class(module) -> type:
    """The model class a family module defines."""
    found = [v for v in vars(module).values() if isinstance(v, type)
             and issubclass(v, TransformerLanguageModel) and v.__module__ == module.__name__]
    if len(found) != 1:
        raise TypeError(f"{module.__name__} must define exactly one TransformerLanguageModel "
                        f"subclass, found {[c.__name__ for c in found]}")
    return found[0]


def family_of(model) -> str | None:
    """The registry key of a model instance's family (None for a plain language model)."""
    for name, module in FAMILIES.items():
        if type(model) is model_class(module):
            return name
    return None


def family(name: str, where: str = "the checkpoint"):
    if name not in FAMILIES:
        raise ValueError(f"{where}: model_type {name!r} is not supported; convert one of "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[name]
