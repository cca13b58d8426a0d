"""What each model family's config looks like: the rules that name a config's family when none is
given, and refuse a config its family cannot compute (one line naming the field).

A family is data: `TransformerConfig.family` is recorded in every checkpoint, and
models/registry.py maps the name to the model class, the Hugging Face adapter and the presets.
The rules are each family folder's rules.py (models/family_folders.py): data that reads only
config fields, so `models/config.py` applies them without importing any family's code; the
registry checks that it registers exactly these names.
"""
from __future__ import annotations

import dataclasses

from .family_folders import load

# models/<family>/rules.py of every family folder: SHAPE (the fields whose value the family
# fixes; dense families also refuse every MoE field that differs from its default, `moe_fields`),
# MOE (a mixture-of-experts family: it needs --num-experts; "mixed": its layers may be dense or
# MoE, config.layer_mlps names which, so the MoE fields are allowed but not needed), NEEDS
# (optional: fields the family needs set; a tuple of fields: one of them, e.g. DeepSeek-V3's
# kv_lora_rank or num_experts), MEGATRON (optional: the Megatron-core tensor layout covers it)
# and INFER_BEFORE (optional: families a config that fits both is inferred not to be, e.g. a
# Llama config fits Mistral's rules too).
_FOLDERS = load("rules")
SHAPES: dict[str, dict] = {name: dict(rules.SHAPE) for name, rules in _FOLDERS.items()}


def _inference_order(names: list[str]) -> tuple[str, ...]:
    """`names` sorted, each moved before the families its INFER_BEFORE names."""
    order = sorted(names)
    for name in sorted(names):
        for later in getattr(_FOLDERS[name], "INFER_BEFORE", ()):
            if later in order and order.index(later) < order.index(name):
                order.remove(name)
                order.insert(order.index(later), name)
    return tuple(order)


MOE_FAMILIES = _inference_order([n for n, rules in _FOLDERS.items() if rules.MOE is True])  # tried in order
DENSE_FAMILIES = _inference_order([n for n in SHAPES if n not in MOE_FAMILIES])
# dense or MoE per layer: inferred for configs with or without experts
MIXED_FAMILIES = tuple(n for n, rules in _FOLDERS.items() if rules.MOE == "mixed")
MEGATRON_FAMILIES = tuple(n for n, rules in _FOLDERS.items() if getattr(rules, "MEGATRON", False))


def moe_fields(config_cls) -> tuple[str, ...]:
    """The mixture-of-experts fields of the config dataclass (`num_experts` and `moe_*`)."""
    return tuple(f.name for f in dataclasses.fields(config_cls)
                 if f.name == "num_experts" or f.name.startswith("moe_"))


def problem(config, family: str) -> str | None:
    """Why `config` is not a `family` model (one line naming the field), or None if it is."""
    if family not in SHAPES:
        return f"family {family!r} is not registered; choose one of {sorted(SHAPES)}"
    for field, want in SHAPES[family].items():
        got = getattr(config, field)
        if got != want:
            return f"family {family!r} needs {field}={want!r}, got {got!r}"
    for need in getattr(_FOLDERS[family], "NEEDS", ()):
        either = need if isinstance(need, tuple) else (need,)  # a tuple: one of them suffices
        if not any(getattr(config, field) for field in either):
            return f"family {family!r} needs {' or '.join(either)} set"
    if getattr(_FOLDERS[family], "MOE", False) == "mixed":
        return None
    if family in MOE_FAMILIES:
        if not config.num_experts:
            return (f"family {family!r} is a mixture of experts: it needs num_experts "
                    f"(--num-experts)")
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
    for field in moe_fields(type(config)):
        if getattr(config, field) != defaults[field]:
            return (f"family {family!r} is dense: {field}={getattr(config, field)!r} is a "
                    f"mixture-of-experts field (name an MoE family, one of {list(MOE_FAMILIES)}, "
                    f"or drop it)")
    return None


def infer_family(config) -> str | None:
    """The first family whose rules `config` satisfies (None: a plain language model that no
    family describes). Used when a config names none: built from flags without a preset, or read
    from a checkpoint written before families were recorded."""
    order = MOE_FAMILIES + MIXED_FAMILIES if config.num_experts else DENSE_FAMILIES
    return next((name for name in order if problem(config, name) is None), None)


def resolve_family(config) -> str | None:
    """The config's family: the one it names, checked, or the inferred one."""
    if config.family is None:
        return infer_family(config)
    reason = problem(config, config.family)
    if reason:
        raise ValueError(reason)
    return config.family
