"""Family folders: a family is one folder `models/<family>/`, named by its Hugging Face
`model_type`, holding what makes it itself:

    rules.py    SHAPE (the config fields the family fixes), MOE, optional NEEDS and MEGATRON,
                LORA (its PEFT target table, models/lora_targets.py) and
                INFER_BEFORE; data only (it may start from models/family_bases.py)
    presets.py  PRESETS (name -> TransformerConfig fields, each naming the family)
    adapter.py  the Hugging Face adapter (config_from_hf, hf_config, from_hf_state_dict,
                to_hf_state_dict)
    model.py    the model class (its `family` attribute is the folder's name)
    family.py   MODEL_CLASS, ADAPTER, DEFAULT_PRESET (what models/registry.py registers)

The registry, family_rules and presets find the folders here; nothing else lists them. Code
several families share lives in modules beside the folders (llama_like.py, qwen_moe_like.py),
never in another family's folder. A folder
builds its layers from layer specs (models/spec.py): it changes no shared block.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

_PARTS = ("rules", "presets", "adapter", "family")


def folder_names() -> list[str]:
    """The family folders under models/ (packages holding a rules.py), sorted."""
    here = Path(__file__).parent
    return sorted(p.name for p in here.iterdir()
                  if (p / "__init__.py").is_file() and (p / "rules.py").is_file())


def load(part: str) -> dict[str, ModuleType]:
    """family name -> that folder's module `part` (one of rules, presets, adapter, family)."""
    if part not in _PARTS:
        raise ValueError(f"a family folder has no part {part!r}; choose one of {_PARTS}")
    return {name: importlib.import_module(f"{__package__}.{name}.{part}") for name in folder_names()}
