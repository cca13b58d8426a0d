"""Named model presets (`--model NAME`): published shapes and tiny test models, each naming its
family (models/registry.py). A preset is data: field values for `TransformerConfig`, written in
its family folder's presets.py; flags override them field by field."""
from __future__ import annotations

from .config import TransformerConfig
from .family_folders import load



def _collect() -> dict[str, dict]:
    """Every family folder's PRESETS (models/<family>/presets.py); a name given twice is an error."""
    presets: dict[str, dict] = {}
    for name, folder in load("presets").items():
        if clash := presets.keys() & folder.PRESETS.keys():
            raise ValueError(f"models/{name}/presets.py: preset {sorted(clash)} is defined by "
                             f"another family folder too; rename one")
        presets.update(folder.PRESETS)
    return presets


PRESETS: dict[str, dict] = _collect()


def preset(name: str, **overrides) -> TransformerConfig:
    """A named preset; keyword overrides win (as individual flags do over --model)."""
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is not a known preset; choose one of {sorted(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})
