"""DeepSeek-V3 folders as transformers writes them and as DeepSeek released them, both ways.

* A random transformers DeepseekV3ForCausalLM saved with `save_pretrained` keeps
  `num_nextn_predict_layers` 1 in config.json but writes no weights for the prediction depth:
  `tools/convert_hf.py import` warns once and imports the model without it, and export writes
  the folder back bit-identical (every tensor, every config.json field).
* The released config.json spells its YaRN scaling `rope_scaling: {"type": "yarn", ...}` beside
  a top-level `rope_theta`; transformers reads `type` as `rope_type`. Import and export accept
  it: the exported folder's logits in transformers equal the original folder's bit for bit, and
  its rope_parameters are the original's in transformers' spelling.
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import hf_deepseek_v3
from tests.tool_runs import convert_hf_tool

YARN_AS_RELEASED = {"beta_fast": 4, "beta_slow": 1, "factor": 4.0, "mscale": 0.7,
                    "mscale_all_dim": 1.3, "original_max_position_embeddings": 8, "type": "yarn"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek") / "hf"
    hf_deepseek_v3(num_nextn_predict_layers=1, max_position_embeddings=32).save_pretrained(folder)
    return folder


def _round_trip(folder, tmp_path, name):
    assert convert_hf_tool("import", "--hf-dir", str(folder), "--save", str(tmp_path / f"{name}_ck")) == 0
    assert convert_hf_tool("export", "--load", str(tmp_path / f"{name}_ck"),
                           "--save", str(tmp_path / f"{name}_out")) == 0
    return tmp_path / f"{name}_out"


def test_transformers_saved_deepseek_v3_without_its_depths_round_trips_bit_identical(
        saved, tmp_path, caplog):
    from safetensors.torch import load_file
    before = load_file(saved / "model.safetensors")
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(k.startswith("model.layers.3.") for k in before)  # transformers drops them
    with caplog.at_level(logging.WARNING):
        out = _round_trip(saved, tmp_path, "saved")
    warned = [r for r in caplog.records if "prediction depth" in r.getMessage()]
    assert len(warned) == 1 and "num_nextn_predict_layers" in warned[0].getMessage()
    after = load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    want, got = (json.loads((f / "config.json").read_text()) for f in (saved, out))
    assert {k: v for k, v in got.items() if k != "transformers_version"} == \
        {k: v for k, v in want.items() if k != "transformers_version"}


def test_released_rope_scaling_spelling_imports_and_exports(saved, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = tmp_path / "released"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.update(rope_theta=theta, rope_scaling=dict(YARN_AS_RELEASED))  # as released
    (folder / "config.json").write_text(json.dumps(config))
    out = _round_trip(folder, tmp_path, "released")
    rope = dict(AutoConfig.from_pretrained(folder).rope_parameters)
    assert rope.pop("type") == "yarn" and rope["rope_type"] == "yarn"
    assert AutoConfig.from_pretrained(out).rope_parameters == rope
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))  # past 8
    with torch.no_grad():
        theirs, ours = (AutoModelForCausalLM.from_pretrained(f).eval()(ids).logits
                        for f in (folder, out))
    assert torch.equal(theirs, ours)
