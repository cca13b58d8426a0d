"""`--load` gives the model: an imported checkpoint fine-tunes without repeating its shape.

* `tools/convert_hf.py import` of a tiny HF Llama (2 layers, hidden 32, GQA, llama3 rope), then
  `train_llama.py --load CK --finetune` with no model flag (the script's default preset is
  SmolLM2-135M, hidden 576) trains 2 iterations in this process; the saved model config is the
  imported one.
* The flags on top of the checkpoint's config: a training setting changes (dropout); a shape
  flag that contradicts the checkpoint is refused in one line naming both values; an explicit
  --model is the preset (refused at load as before), unless --use-checkpoint-args; no --load,
  or a --load that holds no checkpoint yet, leaves the preset.
"""
from __future__ import annotations

import pytest

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import LLAMA3, hf_llama
from tests.tool_runs import convert_hf_tool

RUN = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "1000", "--train-iters", "2"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_shape")
    hf_llama(hidden=32, heads=4, kv_heads=2, layers=2, scaling=LLAMA3).save_pretrained(root / "hf")
    assert convert_hf_tool("import", "--hf-dir", str(root / "hf"), "--save", str(root / "ck")) == 0
    return root


def test_finetune_an_import_without_shape_flags(imported, monkeypatch):
    from megazoo.training.checkpoint.format import latest_checkpoint, read_meta
    from megazoo.training.run.entry import main
    monkeypatch.setattr("megazoo.training.run.trainer.write_report", lambda run_dir: "(not drawn)")
    ck, tuned = str(imported / "ck"), str(imported / "tuned")
    result = main("llama", RUN + ["--load", ck, "--finetune", "--save", tuned])  # train_llama.py
    assert result.checkpoint.endswith("iter_0000002") and len(result.losses) == 2
    saved = read_meta(latest_checkpoint(tuned))["model"]
    want = read_meta(latest_checkpoint(ck))["model"]
    assert saved["hidden_size"] == 32 and saved["family"] == "llama"
    assert {k: v for k, v in saved.items() if k != "seed"} == {k: v for k, v in want.items()
                                                               if k != "seed"}


def test_flags_on_top_of_the_checkpoints_model(imported, tmp_path):
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.entry import loaded_model
    ck = str(imported / "ck")
    loaded = loaded_model(ck)
    assert loaded.hidden_size == 32 and loaded.rope_scaling["rope_type"] == "llama3"

    def model(*flags, load=ck):
        args = build_parser("smollm2-135m").parse_args(RUN + ["--finetune", *flags] +
                                                        (["--load", load] if load else []))
        return to_run_config(args, world_size=1, loaded=loaded_model(load)).model

    assert model().computed_fields() == loaded.computed_fields()
    assert model("--attention-dropout", "0.1").attention_dropout == 0.1
    assert model("--hidden-size", "32", "--bf16").params_dtype == "bfloat16"
    with pytest.raises(ArgumentError, match="holds another model: hidden_size=32 there, 64 here") as e:
        model("--hidden-size", "64")
    assert "\n" not in str(e.value)
    assert model("--model", "smollm2-135m").hidden_size == 576  # as before: refused at load
    assert model("--model", "smollm2-135m", "--use-checkpoint-args").hidden_size == 32
    assert model(load=None).hidden_size == 576
    assert model(load=str(tmp_path / "fresh")).hidden_size == 576  # --save/--load, first run
