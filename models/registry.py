"""The model families: the one place that maps a family name to code.

A family is data: `TransformerConfig.family` (recorded in every checkpoint's model config) names
an entry here, read from its folder (models/<family>/family.py), which gives the model class,
the Hugging Face adapter (the module with `config_from_hf`, `hf_config`, `from_hf_state_dict`,
`to_hf_state_dict`; a family's name is its HF `model_type`) and the presets of that family. Training scripts, HF import and export,
resharding, generation, the dry run and resume all ask it; none compares classes. What a
family's config must look like is its folder's rules.py (models/family_rules.py). Add a family
with one folder (models/family_folders.py); nothing here names one.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from .config import TransformerConfig
from .presets import PRESETS
from .family_folders import load
from .family_rules import SHAPES
from .language_model import TransformerLanguageModel


@dataclass(frozen=True)
class Family:
    name: str  # = the Hugging Face config.json `model_type` = model_class.family = its folder
    model_class: type
    adapter: ModuleType
    default_preset: str | None  # what the family's training script builds without --model

    @property
    def presets(self) -> list[str]:
        return sorted(n for n, fields in PRESETS.items() if fields.get("family") == self.name)


# every family folder's family.py (models/<family>/family.py; models/family_folders.py)
FAMILIES: dict[str, Family] = {name: Family(name, f.MODEL_CLASS, f.ADAPTER, f.DEFAULT_PRESET)
                               for name, f in load("family").items()}
assert all(f.model_class.family == name for name, f in FAMILIES.items()), \
    "a family's model class names another family (its `family` attribute)"
assert FAMILIES.keys() == SHAPES.keys(), "models/family_rules.py and the registry disagree"
assert all(f.default_preset is None or f.default_preset in f.presets for f in FAMILIES.values()), \
    "a family.py's DEFAULT_PRESET is not one of its folder's presets"


def family(name: str | None, where: str = "the checkpoint") -> Family:
    """The registry entry of a family name; `where` names the file or flag for the error."""
    if name is None:
        raise ValueError(f"{where} records no model family (a plain language model: no family's "
                         f"rules fit its fields); families: {sorted(FAMILIES)}")
    if name not in FAMILIES:
        raise ValueError(f"{where}: model_type {name!r} is not supported; convert one of "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[name]


def model_class(config: TransformerConfig) -> type:
    """The class that builds `config` (a config no family describes: the plain language model)."""
    return TransformerLanguageModel if config.family is None else family(config.family).model_class


def build_model(config: TransformerConfig, topo, **kwargs) -> TransformerLanguageModel:
    """The model provider of every training script, tool and conversion: one model chunk of
    `config`'s family (kwargs: rng, pre_process, post_process, layer_range)."""
    return model_class(config)(config, topo, **kwargs)


