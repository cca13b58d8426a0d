"""A family is a folder (models/family_folders.py), one process, no model built:

every folder holding a rules.py has its parts, its model class names the folder, its adapter
has the four conversions, and the registry, the rules and the presets hold exactly the folders;
no code outside the folders imports one or keeps a list of family names (the script -> default family map of the console
commands and LoRA's module names aside); no folder imports another family's folder. A config
naming no family is inferred as before the move (a Llama config fits Mistral's rules too, a
window-less Mixtral Qwen2-MoE's), and two folders defining one preset name are refused.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazoo.models import family_folders, family_rules, presets
from megazoo.models.presets import PRESETS, preset
from megazoo.models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
PARTS = ("__init__", "rules", "presets", "family")  # family.py names the model class and adapter
ADAPTER = ("config_from_hf", "hf_config", "from_hf_state_dict", "to_hf_state_dict")
# code outside the folders that may name several families: the console commands' script ->
# default family map (each train_*.py names its one default too) and LoRA's per-family names
NAMED_ELSEWHERE = {"training/run/cli.py"}


def test_the_registry_rules_and_presets_are_the_folders():
    names = family_folders.folder_names()
    assert {"gpt2", "bloom", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe",
            "qwen3_moe", "deepseek_v3", "gemma3_text", "gpt_oss"} <= set(names)
    for name in names:
        assert all((MODELS / name / f"{part}.py").is_file() for part in PARTS), name
        assert FAMILIES[name].model_class.family == name
        assert FAMILIES[name].adapter.__name__.startswith(f"megazoo.models.{name}.")
        assert all(callable(getattr(FAMILIES[name].adapter, f)) for f in ADAPTER), name
    assert sorted(FAMILIES) == sorted(family_rules.SHAPES) == names
    folder_presets = {n: p for name in names
                      for n, p in family_folders.load("presets")[name].PRESETS.items()}
    assert folder_presets == PRESETS and all(p["family"] in names for p in PRESETS.values())
    assert set(family_rules.MEGATRON_FAMILIES) == {"gpt2", "bloom", "llama", "qwen2", "qwen3",
                                                   "mixtral", "qwen2_moe", "qwen3_moe",
                                                   "deepseek_v3"}


def _sources():
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".", "tests/", "bench/", "build/")) or "/." in rel:
            continue
        yield rel, path.read_text()


def test_no_family_list_outside_the_folders_and_no_folder_imports_another():
    names = family_folders.folder_names()
    quoted = re.compile(r"""["'](%s)["']""" % "|".join(names))
    folder_import = re.compile(r"^\s*from \.\.?(%s)[\s.]" % "|".join(names), re.M)
    checked = 0
    for rel, text in _sources():
        parts = rel.split("/")
        in_folder = len(parts) == 3 and parts[0] == "models" and parts[1] in names
        if in_folder:  # a folder imports shared modules only, never another family's folder
            assert not [m for m in folder_import.findall(text) if m != parts[1]], rel
            continue
        if rel.startswith("models/"):
            assert not folder_import.findall(text), f"{rel} imports a family folder"
        if rel in NAMED_ELSEWHERE:
            continue
        # a list: three or more family names within one statement-sized stretch
        for match in quoted.finditer(text):
            window = text[match.start():match.start() + 200]
            assert len(set(quoted.findall(window))) < 3, f"{rel}: a family list: {window!r}"
        checked += 1
    assert checked > 50


def test_a_config_naming_no_family_is_inferred_as_before():
    llama = preset("smollm2-135m", family=None)
    assert llama.family == "llama"
    assert family_rules.problem(llama, "mistral") is None  # fits both: the order decides
    mixtral = preset("moe-tiny", family=None)
    assert mixtral.family == "mixtral"
    assert family_rules.problem(mixtral.replace(family="qwen2_moe"), "qwen2_moe") is None
    assert preset("qwen3-moe-30b-a3b", family=None).family == "qwen3_moe"
    deepseek = preset("deepseek-v3-tiny", family=None)
    assert deepseek.family == "deepseek_v3"
    # DeepSeek-V3's forms: dense MLA, MoE under GQA; a config with neither MLA nor experts is not
    # one, and a softmax MoE config is inferred as the softmax-router family first
    assert deepseek.replace(family=None, num_experts=None).family == "deepseek_v3"
    assert deepseek.replace(family=None, kv_lora_rank=None, q_lora_rank=None).family == \
        "deepseek_v3"
    assert family_rules.problem(llama, "deepseek_v3") == \
        "family 'deepseek_v3' needs kv_lora_rank or num_experts set"
    assert preset("mistral-tiny", family=None).family == "mistral"  # its window: not Llama
    order = family_rules.DENSE_FAMILIES
    assert order.index("llama") < order.index("mistral")
    assert family_rules.MOE_FAMILIES.index("mixtral") < family_rules.MOE_FAMILIES.index("qwen2_moe")


def test_a_preset_name_in_two_folders_is_refused(monkeypatch):
    a = SimpleNamespace(PRESETS={"tiny": dict(family="a")})
    b = SimpleNamespace(PRESETS={"tiny": dict(family="b")})
    monkeypatch.setattr(presets, "load", lambda part: {"a": a, "b": b})
    with pytest.raises(ValueError, match=r"models/b/presets.py: preset \['tiny'\] is defined by "
                                         r"another family folder too"):
        presets._collect()
