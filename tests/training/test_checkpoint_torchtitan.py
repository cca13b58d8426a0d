"""torchtitan checkpoints as torchtitan 0.2.0 itself writes and reads them.

The golden files (tests/fixtures/torchtitan/, README.md there) were written by torchtitan's own
Llama 3 and Qwen3 models, optimizer container, LR schedulers and CheckpointManager: `step-3/` an
interval save with every state after 3 AdamW steps, `step-6/` the last save, model-only in bf16,
`qwen3/step-2/` a model-only Qwen3 (tied embeddings, q/k norms). Checked here: imported at tp=2,
the logits equal torchtitan's own forward within the fp32 tolerance (step-6's: torchtitan's model
after its CheckpointManager loaded the bf16 save); megazoo resumed from step-3 at tp=2 continues
with torchtitan's next three losses (and Adam restarted from the weights alone does not); the
moments' rows follow the weights' through the RoPE reordering; without that reordering the logits
are far off; the export holds torchtitan's own tensors bit for bit under torchtitan's names (that
torchtitan's CheckpointManager loads such an export with equal logits is make_golden.py
--check-export); bad input is refused in one line.
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.fixtures import TORCHTITAN
from tests.foreign_checkpoints import FP32, megazoo_logits
from tests.tool_runs import tool_output

STEP3, STEP6 = TORCHTITAN / "checkpoint" / "step-3", TORCHTITAN / "checkpoint" / "step-6"
QWEN3 = TORCHTITAN / "qwen3"


def _reference():
    from safetensors.torch import load_file
    return load_file(str(TORCHTITAN / "reference.safetensors"))


def _import(load, save, hf=TORCHTITAN, *extra):
    rc, out, err = tool_output("convert_checkpoint", "import", "--format", "torchtitan",
                               "--load", load, "--hf-config", hf, "--save", save, *extra)
    assert rc == 0, err
    return out.strip()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """step-3 and the checkpoint folder (its newest save, step-6) imported at tp=2, Qwen3 too."""
    out = tmp_path_factory.mktemp("torchtitan")
    return {"step3": _import(STEP3, out / "step3", TORCHTITAN, "--tp", "2"),
            "step6": _import(TORCHTITAN / "checkpoint", out / "step6", TORCHTITAN, "--tp", "2"),
            "qwen3": _import(QWEN3, out / "qwen3", TORCHTITAN / "qwen3_hf", "--tp", "2")}


def _tp2_world(rank, folders, ids, batches, lr):
    """At tp=2: the logits of every imported checkpoint, then step-3 resumed on torchtitan's next
    batches with its Adam state and with fresh moments: the losses of each."""
    torch.set_num_threads(1)
    from megazoo.models.language_model import gather_logits
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.checkpoint import reshard
    from megazoo.training.checkpoint.hf import checkpoint_config
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    out = {}
    for name, folder in folders.items():
        _, config = checkpoint_config(folder)
        model = build_model(config, topo)
        reshard.load_weights(folder, [model], topo)
        with torch.no_grad():
            out[name] = gather_logits(model.eval()(ids), topo, config.vocab_size).numpy()
    for fresh in (False, True):
        _, config = checkpoint_config(folders["step3"])
        model = build_model(config, topo)
        opt = build_optimizer(model, topo, OptimizerConfig(lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                                           weight_decay=0.0), torch.float32)
        reshard.load_into(reshard.read_full_state(folders["step3"]), [model], opt, topo,
                          weights_only=fresh, folder=folders["step3"])
        losses = []
        for tokens in batches:
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["fresh" if fresh else "resumed"] = losses
    return out


@pytest.fixture(scope="module")
def tp2(imported):
    ref = _reference()
    ranks = run_distributed(_tp2_world, 2, imported, ref["ids"], list(ref["batches"][3:]),
                            float(ref["lrs"][0]))
    assert ranks[0]["resumed"] == ranks[1]["resumed"]
    return ranks[0]


def test_logits_at_tp2_equal_torchtitans(tp2):
    ref = _reference()
    for name, key in (("step3", "logits_step3"), ("step6", "logits_step6"),
                      ("qwen3", "qwen3_logits")):
        torch.testing.assert_close(torch.from_numpy(tp2[name]), ref[key], **FP32, msg=name)


def test_megazoo_continues_with_torchtitans_next_losses(tp2):
    want = _reference()["next_losses"].tolist()
    assert len(tp2["resumed"]) == len(want) == 3
    torch.testing.assert_close(torch.tensor(tp2["resumed"]), torch.tensor(want), **FP32)
    # the moments matter: Adam restarted from the weights alone takes another second step
    assert tp2["fresh"][0] == pytest.approx(want[0], rel=1e-5)
    assert abs(tp2["fresh"][1] - want[1]) > 100 * abs(tp2["resumed"][1] - want[1]) + 1e-4


def test_adam_state_follows_the_weights_and_the_counters_carry(imported):
    """Each imported row of qkv (weights and moments) is one of torchtitan's wq/wk/wv rows: the
    moments' rows sit where the weights' rows do (found by the weight values, not by the code's
    permutation); step and iteration are torchtitan's."""
    from megazoo.training.checkpoint.foreign.torchtitan import _read
    from megazoo.training.checkpoint.reshard import read_full_state
    import torch.distributed.checkpoint as dcp
    full = read_full_state(imported["step3"])
    metadata = dcp.FileSystemReader(str(STEP3)).read_metadata().state_dict_metadata
    names = [f"layers.1.attention.w{x}.weight" for x in "qkv"]
    keys = names + [f"optimizer.state.{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq")]
    theirs = _read(str(STEP3), metadata, keys)
    rows = torch.cat([theirs[n] for n in names])
    moments = {s: torch.cat([theirs[f"optimizer.state.{n}.{s}"] for n in names])
               for s in ("exp_avg", "exp_avg_sq")}
    qkv = full.optim["master"]["layers.1.attention.qkv.weight"]
    assert torch.equal(qkv, full.weights["layers.1.attention.qkv.weight"])
    match = (qkv[:, None, :] == rows[None, :, :]).all(-1)
    assert match.sum(1).eq(1).all() and match.sum(0).eq(1).all()  # a permutation of rows
    where = match.float().argmax(1)
    assert not torch.equal(where, torch.arange(len(where)))  # rows did move
    for s in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(full.optim[s]["layers.1.attention.qkv.weight"], moments[s][where]), s
    assert int(full.scalars["applied_steps"]) == 3 and full.meta["iteration"] == 3
    assert read_full_state(imported["step6"]).optim == {}  # model-only: weights only


def test_inspect_names_the_format():
    for path, want in ((STEP3, "torchtitan checkpoint (step-3): 2 layers, float32 weights, with "
                               "optimizer state"),
                       (TORCHTITAN / "checkpoint",
                        "(step-6): 2 layers, bfloat16 weights, model-only")):
        rc, out, _ = tool_output("inspect_checkpoint", path)
        assert rc == 0 and want in out and "--format torchtitan" in out, out


def test_rope_pairs_must_be_reordered(tmp_path):
    """Read as if torchtitan's llama3 rotated halves (no reordering), the logits are far off."""
    import torch.distributed.checkpoint as dcp
    from megazoo.models.llama import adapter
    from megazoo.training.checkpoint.foreign import torchtitan
    from megazoo.training.checkpoint.hf import read_hf_config
    from megazoo.training.checkpoint.layout_writer import write_layout
    from megazoo.training.checkpoint.reshard import FullState
    config = adapter.config_from_hf(read_hf_config(str(TORCHTITAN))[2])
    metadata = dcp.FileSystemReader(str(STEP3)).read_metadata().state_dict_metadata
    model = {"tok_embeddings", "layers", "norm", "output"}
    keys = [k for k in metadata if k.split(".")[0] in model]
    sd = torchtitan._read(str(STEP3), metadata, keys)
    ref = _reference()
    diffs = []
    for interleaved in (True, False):
        full = adapter.from_hf_state_dict(torchtitan.to_hf(sd, config, interleaved), config)
        folder = write_layout(FullState({"consumed_samples": 0, "skipped_steps": 0}, full),
                              str(tmp_path / str(interleaved)), config=config)
        diffs.append((megazoo_logits(folder, ref["ids"]) - ref["logits_step3"]).abs().max().item())
    assert diffs[0] < 1e-5 < 1e-2 < diffs[1], diffs


def test_export_is_torchtitans_own_tensors(imported, tmp_path):
    """Exported (Llama from step-3, Qwen3): torchtitan's model-only names, torchtitan's tensors
    bit for bit (fp32), the tied Qwen3 head under both names as its model keeps it."""
    import torch.distributed.checkpoint as dcp
    from megazoo.training.checkpoint.foreign.torchtitan import _read
    for name, source, step in (("step3", STEP3, 3), ("qwen3", QWEN3 / "step-2", 2)):
        rc, out, err = tool_output("convert_checkpoint", "export", "--format", "torchtitan",
                                   "--load", imported[name], "--save", tmp_path / name)
        assert rc == 0, err
        folder = str(tmp_path / name / f"step-{step}")
        assert out.strip() == folder
        got_md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        want_md = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata
        model_keys = sorted(k for k in want_md if "." in k and k.split(".")[0] in
                            {"tok_embeddings", "layers", "norm", "output"})
        assert sorted(got_md) == model_keys, name
        got, want = _read(folder, got_md, model_keys), _read(str(source), want_md, model_keys)
        for k in model_keys:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float()), (name, k)


def test_bad_input_is_refused_in_one_line(tmp_path):
    import json
    cases = []
    hf = tmp_path / "wide"
    hf.mkdir()
    config = json.loads((TORCHTITAN / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    cases.append((["import", "--load", STEP3, "--hf-config", hf],
                  "layers.0.feed_forward.w2.weight has shape (32, 96), config.json gives (32, 64)"))
    cases.append((["import", "--load", STEP3], "records no model configuration; pass --hf-config"))
    cases.append((["import", "--load", STEP3, "--hf-config", TORCHTITAN, "--vocab-size", "100"],
                  "--vocab-size applies to --format"))
    cases.append((["import", "--load", tmp_path, "--hf-config", TORCHTITAN],
                  "neither a torchtitan step-N folder"))
    cases.append((["import", "--load", QWEN3, "--hf-config", TORCHTITAN],
                  "the checkpoint holds ['layers.0.attention.k_norm.weight'"))
    from transformers import Qwen3MoeConfig
    Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=96, moe_intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path / "moe")
    cases.append((["import", "--load", QWEN3, "--hf-config", tmp_path / "moe"],
                  "model_type 'qwen3_moe'; megazoo maps torchtitan's ['llama', 'qwen3']"))
    cases.append((["export", "--load", STEP3, "--tp", "2"], "drop the layout flags"))
    (tmp_path / "rope").mkdir()  # torchtitan's llama3 always scales RoPE as Llama 3.1
    (tmp_path / "rope" / "config.json").write_text(json.dumps(
        {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}))
    cases.append((["import", "--load", STEP3, "--hf-config", tmp_path / "rope"],
                  'applies Llama 3.1\'s scaling to every model (RoPEScalingArgs): put '
                  '"rope_parameters": {"rope_type": "llama3", "factor": 8.0'))
    import collections
    import pickle
    (tmp_path / "evil").mkdir()  # a .metadata that would build another class than DCP's
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(collections.OrderedDict()))
    cases.append((["import", "--load", tmp_path / "evil", "--hf-config", TORCHTITAN],
                  "holds collections.OrderedDict, outside DCP's metadata classes; refused"))
    for argv, message in cases:
        rc, _, err = tool_output("convert_checkpoint", argv[0], "--format", "torchtitan",
                                 *argv[1:], "--save", tmp_path / "out")
        assert rc == 1 and message in err and len(err.strip().splitlines()) == 1, (argv, err)


def _rewrite(dst, **group):
    """A copy of step-3 written again by DCP with its optimizer's group fields set to `group`
    (as torchtitan records another optimizer's settings, e.g. optimizer.name Adam)."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from megazoo.training.checkpoint.foreign import safe_load, torchtitan
    metadata = safe_load.dcp_metadata(str(STEP3)).state_dict_metadata
    sd = torchtitan._read(str(STEP3), metadata, sorted(metadata))
    for k in sd:
        field = k.rsplit(".", 1)[-1]
        if k.startswith("optimizer.param_groups.") and field in group:
            sd[k] = group[field]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    return dst


def test_other_adam_settings_are_refused_and_a_decay_is_said(tmp_path, caplog):
    """torchtitan's Adam (L2 decay) and amsgrad are refused; AdamW's decay, which torchtitan
    applies to every parameter, is imported with a warning saying so."""
    from megazoo.training.checkpoint.foreign import torchtitan
    refused = ((dict(decoupled_weight_decay=False, weight_decay=0.1),
                "torch Adam with weight_decay=0.1 (L2 in the gradient"),
               (dict(amsgrad=True), "AdamW with amsgrad/maximize"))
    for i, (group, message) in enumerate(refused):
        rc, _, err = tool_output("convert_checkpoint", "import", "--format", "torchtitan",
                                 "--load", _rewrite(tmp_path / f"bad{i}", **group),
                                 "--hf-config", TORCHTITAN, "--save", tmp_path / "out")
        assert rc == 1 and message in err and len(err.strip().splitlines()) == 1, err
    decayed = _rewrite(tmp_path / "decayed", weight_decay=0.1)
    with caplog.at_level("INFO"):
        _, _, full, _ = torchtitan.read(str(decayed), hf_config=str(TORCHTITAN))
    assert sorted(full.optim) == ["exp_avg", "exp_avg_sq", "master"]
    said = [r for r in caplog.records if "decayed every parameter by 0.1" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"


def test_newest_step_with_metadata_is_read(tmp_path, caplog):
    """As torchtitan's loader: step-N folders without .metadata are skipped (logged); an HF save
    newest is refused, naming it and --format hf."""
    import shutil
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.foreign.torchtitan import step_folder
    root = tmp_path / "checkpoint"
    shutil.copytree(STEP3, root / "step-3")
    (root / "step-10").mkdir()  # an unfinished save
    with caplog.at_level("INFO"):
        assert step_folder(str(root)) == str(root / "step-3")
    assert f"{root / 'step-10'}: no .metadata" in caplog.text
    (root / "step-12").mkdir()
    (root / "step-12" / "model.safetensors.index.json").write_text("{}")
    for where in (root, root / "step-12"):
        with pytest.raises(CheckpointError, match="import it with --format hf") as e:
            step_folder(str(where))
        assert str(root / "step-12") in str(e.value)


def test_export_never_overwrites_a_save(imported, tmp_path):
    """An existing step-N is refused in one line and left as it was; the export is written in a
    temporary sibling then renamed (none left behind)."""
    argv = ("convert_checkpoint", "export", "--format", "torchtitan", "--load",
            imported["step3"], "--save", tmp_path)
    assert tool_output(*argv)[0] == 0
    before = sorted(p.name for p in (tmp_path / "step-3").iterdir())
    rc, _, err = tool_output(*argv)
    assert rc == 1 and "step-3 exists (a torchtitan save is not overwritten)" in err \
        and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
