"""Megatron-LM checkpoints written by Megatron-LM itself (tests/fixtures/megatron_lm/, its
README.md names the Megatron-LM release and the command lines).

The files come from Megatron-LM's own tools/checkpoint/convert.py and save_checkpoint: a tiny
random Hugging Face Llama through `--loader llama_mistral --saver legacy` at tp2 and tp2/pp2, and
a GPT-2-shaped megazoo export read by `--loader core` and re-saved with `--saver legacy` at tp2
(so Megatron-LM loaded what megazoo writes), and a Llama-shaped Megatron-core model after two
steps of Megatron's own optimizer, saved by save_checkpoint with optimizer, scheduler and RNG
state (and the same as a legacy model, `--use-legacy-models`, as GPT-3-era runs saved). Checked: every file loads with
`weights_only=True` through the allowlist; imported at other layouts, the logits equal the
source model's stored reference logits within 1e-5; the round trip through Megatron-LM's
converter is bit for bit; the QKV orders of checkpoint_version 0 and 1.0 (rewritten here from a
real file, as Megatron-LM's fix_query_key_value_ordering reads them) come back to the same
weights; a tensor of another legacy model is refused by name; the trained file's Adam moments,
fp32 weights, step, iteration and consumed samples carry over exactly.

Megatron-LM core_v0.16.1's training loop in its default `--ckpt-format torch_dist` (plain
optimizer; distributed optimizer on two data-parallel ranks in its `dp_reshardable` and
`fully_reshardable` forms): imported at tp2 / pp2 with Megatron's logits, masters, moments, step,
iteration and samples exactly; the export's optimizer entry in Megatron's form; the optimizer
forms not read refused in one line naming the flag to re-save with.
"""
import os

import pytest
import torch

from tests.fixtures import MEGATRON_LM
from tests.foreign_checkpoints import FP32, megazoo_logits

LLAMA = ("llama_tp2", "llama_tp2_pp2")


def _reference(name):
    from safetensors.torch import load_file
    return load_file(str(MEGATRON_LM / f"{name}_reference.safetensors"))


def _files(name):
    return sorted(str(p) for p in (MEGATRON_LM / name).rglob("model_optim_rng.pt"))


def _weights(folder):
    from megazoo.training.checkpoint.reshard import read_full_state
    return read_full_state(folder).weights


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each golden checkpoint imported once at a layout other than its own."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    tmp = tmp_path_factory.mktemp("golden")
    layouts = {"llama_tp2": (1, 1), "llama_tp2_pp2": (1, 2), "gpt_tp2": (4, 1),
               "gpt_megazoo_export": (2, 2), "trained_tp1": (2, 2),
               "trained_legacy_tp1": (2, 1)}
    return {name: import_checkpoint("megatron", str(MEGATRON_LM / name), str(tmp / name),
                                    tp=tp, pp=pp)
            for name, (tp, pp) in layouts.items()}


def test_megatron_lm_files_load_through_the_allowlist():
    from megazoo.training.checkpoint.foreign import safe_load
    checked = 0
    for name in LLAMA + ("gpt_tp2", "trained_tp1", "trained_legacy_tp1"):
        for path in _files(name):
            sd = safe_load.load(path)  # weights_only=True with the allowlist
            assert {"args", "checkpoint_version", "iteration", "model", "rerun_state_machine",
                    "num_floating_point_operations_so_far"} <= set(sd)
            # the stand-in, or Megatron-core's own enum where an imported megatron-core has
            # added it to torch's safe globals itself
            mode = sd["rerun_state_machine"]["mode"]
            assert type(mode).__name__ == "RerunMode" and mode.value == "disabled"
            assert sd["checkpoint_version"] == 3.0
            legacy = name != "trained_tp1"
            assert bool(sd["args"].use_legacy_models) == legacy == ("language_model" in sd["model"])
            checked += 1
    assert checked == 2 + 4 + 2 + 1 + 1


@pytest.mark.parametrize("name", ["llama_tp2", "llama_tp2_pp2", "gpt_tp2", "gpt_megazoo_export",
                                  "trained_tp1", "trained_legacy_tp1"])
def test_megatron_lm_file_imported_at_another_layout_gives_the_reference_logits(imported, name):
    ref = _reference(name.split("_")[0] if name != "trained_legacy_tp1" else "trained_legacy")
    logits = megazoo_logits(imported[name], ref["input_ids"])
    # Megatron's trained logits span its padded vocabulary (112); the import keeps the 100 tokens
    torch.testing.assert_close(logits, ref["logits"][..., :logits.shape[-1]], **FP32)


@pytest.mark.parametrize("name", ["trained_tp1", "trained_legacy_tp1"])
def test_megatron_lm_save_checkpoint_with_optimizer_carries_it_over(imported, name):
    from megazoo.training.checkpoint.foreign import megatron_legacy_model, safe_load
    from megazoo.training.checkpoint.reshard import read_full_state
    sd = safe_load.load(_files(name)[0])
    assert {"optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine"} <= set(sd)
    sd["model"] = megatron_legacy_model.stage_models(sd, 1, name, 4)[0]  # Megatron-core names
    full = read_full_state(imported[name])
    assert (full.meta["iteration"], full.meta["consumed_samples"]) == (2, 4)
    assert {k: int(v) for k, v in full.scalars.items()} == {"iteration": 2, "applied_steps": 2}
    assert full.meta["source"]["scheduler"]["lr_decay_style"] == "cosine"
    opt = sd["optimizer"]
    params = [k for k, v in sd["model"].items() if isinstance(v, torch.Tensor)]
    by_group = [[k for k in params if (k.endswith("bias") or sd["model"][k].dim() == 1) ==
                 (g["wd_mult"] == 0.0)] for g in opt["param_groups"]]
    names = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
             "decoder.layers.1.mlp.linear_fc1.weight": "layers.1.mlp.fc1.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight": "layers.0.attention.qkv.weight",
             "decoder.layers.1.pre_mlp_layernorm.weight": "layers.1.post_attention_norm.weight",
             "output_layer.weight": "head_weight"}
    checked = 0
    for group, keys in zip(opt["param_groups"], by_group):
        for idx, key in zip(group["params"], keys):
            if key in names:
                rows = slice(0, 100)  # the vocabulary padding is cut
                for s in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(full.optim[s][names[key]], opt["state"][idx][s][rows])
                assert torch.equal(full.optim["master"][names[key]], sd["model"][key][rows])
                assert int(opt["state"][idx]["step"]) == 2
                checked += 1
    assert checked == len(names)


def test_megatron_lm_converter_round_trip_is_exact(imported, tmp_path):
    """megazoo's export -> Megatron-LM's converter (tp1 -> tp2, legacy model) -> import: every
    weight bit for bit; both Llama layouts Megatron wrote hold the same weights; today's export
    of the import equals the file Megatron-LM's converter loaded, tensor for tensor."""
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint
    pairs = [("gpt_megazoo_export", "gpt_tp2"), LLAMA]
    checked = 0
    for a, b in pairs:
        wa, wb = _weights(imported[a]), _weights(imported[b])
        assert set(wa) == set(wb)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (a, b, k)
            checked += 1
    again = export_checkpoint("megatron", imported["gpt_megazoo_export"], str(tmp_path / "mg"))
    new = safe_load.load(os.path.join(again, "mp_rank_00", "model_optim_rng.pt"))
    old = safe_load.load(_files("gpt_megazoo_export")[0])
    assert list(new["model"]) == list(old["model"])
    assert all(torch.equal(new["model"][k], old["model"][k]) for k in old["model"])
    assert vars(new["args"]) == vars(old["args"])
    assert checked > 30


def _old_qkv_order(t, version, heads):
    """A rank's QKV rows of checkpoint_version 3.0 (no grouping: per head [q; k; v]) in the
    order of version 0 ([3, heads, head_dim]) or 1.0 ([heads, head_dim, 3])."""
    rest = tuple(t.shape[1:])
    t = t.reshape((heads, 3, t.shape[0] // (3 * heads)) + rest)
    t = t.transpose(0, 1) if version == 0 else t.transpose(1, 2)
    return t.reshape((-1,) + rest).contiguous()


def _resave(path, sd):
    """torch.save of a file read through the allowlist: the stand-ins for Megatron's enums do
    not pickle, so the args keep plain values and the rerun state is dropped."""
    import argparse

    from megazoo.training.checkpoint.foreign.safe_load import ForeignValue
    sd["args"] = argparse.Namespace(**{k: v for k, v in vars(sd["args"]).items()
                                       if not isinstance(v, ForeignValue)})
    sd.pop("rerun_state_machine", None)
    torch.save(sd, path)


def test_megatron_lm_older_qkv_orders_and_foreign_tensors(imported, tmp_path):
    import shutil

    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    want = _weights(imported["gpt_tp2"])
    for version in (0, 1.0):
        root = tmp_path / f"v{version}"
        shutil.copytree(MEGATRON_LM / "gpt_tp2", root)
        for path in root.rglob("model_optim_rng.pt"):
            sd = safe_load.load(str(path))
            enc = sd["model"]["language_model"]["encoder"]
            for k in [k for k in enc if ".query_key_value." in k and enc[k] is not None]:
                enc[k] = _old_qkv_order(enc[k], version, 2)  # 4 heads over tp2
            sd["checkpoint_version"] = version
            _resave(path, sd)
        got = _weights(import_checkpoint("megatron", str(root), str(tmp_path / f"mz{version}")))
        assert all(torch.equal(got[k], want[k]) for k in want)
    path = next(root.rglob("model_optim_rng.pt"))
    sd = safe_load.load(str(path))
    sd["model"]["language_model"]["pooler"] = {"dense.weight": torch.zeros(2, 2)}
    _resave(path, sd)
    with pytest.raises(CheckpointError, match=r"language_model.pooler.dense.weight is not a "
                                              r"tensor of Megatron-LM's legacy GPT model"):
        import_checkpoint("megatron", str(root), str(tmp_path / "refused"))


# Megatron-LM core_v0.16.1's training loop in its default --ckpt-format torch_dist (written by
# make_golden_dist.py): the plain optimizer, and the distributed optimizer on two data-parallel
# ranks in its default `dp_reshardable` form and in `fully_reshardable`. The two distributed
# runs are the same run (seed, data, steps) saved two ways.
DIST = {"trained_dist_tp1": (None, (2, 2)), "trained_distopt_dp2": ("dp_reshardable", (2, 2)),
        "trained_distopt_full_dp2": ("fully_reshardable", (1, 2))}
# Megatron-core sharded key (layer or None) -> megazoo name; the vocabulary padding is cut
DIST_NAMES = {("embedding.word_embeddings.weight", None): "embedding.word_embeddings.weight",
              ("decoder.layers.mlp.linear_fc1.weight", 1): "layers.1.mlp.fc1.weight",
              ("decoder.layers.self_attention.linear_qkv.weight", 0):
                  "layers.0.attention.qkv.weight",
              ("decoder.layers.mlp.linear_fc1.layer_norm_weight", 1):
                  "layers.1.post_attention_norm.weight",
              ("decoder.layers.self_attention.linear_proj.weight", 1):
                  "layers.1.attention.dense.weight",
              ("decoder.final_layernorm.weight", None): "final_norm.weight",
              ("output_layer.weight", None): "head_weight"}


def _dist_tensors(name, prefix):
    """The tensors of a torch_dist golden folder whose keys start with `prefix`, read with
    torch.distributed.checkpoint alone (not megazoo's reader)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    folder = str(MEGATRON_LM / name / "iter_0000002")
    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata) and k.startswith(prefix)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return out


@pytest.fixture(scope="module")
def imported_dist(tmp_path_factory):
    """Each torch_dist golden checkpoint imported once at tp=2 and/or pp=2."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    tmp = tmp_path_factory.mktemp("golden_dist")
    return {name: import_checkpoint("megatron-dist", str(MEGATRON_LM / name), str(tmp / name),
                                    tp=tp, pp=pp)
            for name, (_, (tp, pp)) in DIST.items()}


def test_megatron_lm_torch_dist_training_checkpoints_import_with_logits_and_optimizer(
        imported_dist):
    from safetensors.torch import load_file

    from megazoo.training.checkpoint.foreign import megatron_dist, megatron_dist_optim, safe_load
    from megazoo.training.checkpoint.reshard import read_full_state
    ref = load_file(str(MEGATRON_LM / "trained_dist_reference.safetensors"))
    full_form = _dist_tensors("trained_distopt_full_dp2", "")  # Megatron's model-space form
    checked = 0
    for name, (kind, _) in DIST.items():
        common = safe_load.load(str(MEGATRON_LM / name / "iter_0000002" / "common.pt"))
        assert megatron_dist_optim.sharding_type(common) == kind
        assert megatron_dist.describe(str(MEGATRON_LM / name)).endswith(
            f"distributed optimizer ({kind})" if kind else ", optimizer")
        logits = megazoo_logits(imported_dist[name], ref["input_ids"])
        torch.testing.assert_close(logits, ref[name][..., :logits.shape[-1]], **FP32)
        full = read_full_state(imported_dist[name])
        assert (full.meta["iteration"], full.meta["consumed_samples"]) == (2, 4)
        assert {k: int(v) for k, v in full.scalars.items()} == {"iteration": 2, "applied_steps": 2}
        assert full.meta["source"]["scheduler"]["lr_decay_style"] == "cosine"
        # Megatron's own tensors: this file's model-space state, or (dp_reshardable: flat
        # buckets) the same run's model-space state Megatron wrote with fully_reshardable
        own = _dist_tensors(name, "") if kind != "dp_reshardable" else full_form
        if kind == "dp_reshardable":
            weights = _dist_tensors(name, "embedding.")
            assert all(torch.equal(weights[k], own[k]) for k in weights)  # the same run
        master = "optimizer.state.param." if kind else ""  # fp32: the weights are the masters
        for (key, layer), canon in DIST_NAMES.items():
            for state, prefix in (("exp_avg", "optimizer.state.exp_avg."),
                                  ("exp_avg_sq", "optimizer.state.exp_avg_sq."),
                                  ("master", master)):
                want = own[prefix + key]
                want = want[layer] if layer is not None else want
                if canon.endswith(("word_embeddings.weight", "head_weight")):
                    want = want[:100]
                assert torch.equal(full.optim[state][canon], want), (name, state, canon)
                checked += 1
    assert checked == 3 * len(DIST_NAMES) * 3


def test_megatron_lm_torch_dist_export_has_megatron_optimizer_groups(imported_dist, tmp_path):
    """megazoo's torch_dist export writes common.pt's optimizer as Megatron-LM's plain optimizer
    saved it (the groups Megatron matches on load; Megatron-LM's load_checkpoint resuming the
    export is make_golden_dist.py's one-time check), and reads back bit for bit."""
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    out = export_checkpoint("megatron-dist", imported_dist["trained_dist_tp1"],
                            str(tmp_path / "mg"))
    keys = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
    groups = [[tuple(g[k] for k in keys) for g in safe_load.load(os.path.join(
        folder, "common.pt"))["optimizer"]["param_groups"]]
        for folder in (out, str(MEGATRON_LM / "trained_dist_tp1" / "iter_0000002"))]
    assert groups[0] == groups[1] and len(groups[0]) == 2
    back = read_full_state(import_checkpoint("megatron-dist", str(tmp_path / "mg"),
                                             str(tmp_path / "back")))
    first = read_full_state(imported_dist["trained_dist_tp1"])
    for part in ("exp_avg", "exp_avg_sq", "master"):
        assert all(torch.equal(back.optim[part][k], first.optim[part][k]) for k in first.weights)
    assert back.scalars["applied_steps"] == 2


def _rewrite_common(folder, change):
    """common.pt of a copied torch_dist folder changed by `change(sd)` (args without the
    allowlist's enum stand-ins, which do not pickle)."""
    import argparse

    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.safe_load import ForeignValue
    path = os.path.join(folder, "iter_0000002", "common.pt")
    sd = safe_load.load(path)
    sd["args"] = argparse.Namespace(**{k: v for k, v in vars(sd["args"]).items()
                                       if not isinstance(v, ForeignValue)})
    change(sd)
    torch.save(sd, path)


def test_megatron_lm_torch_dist_optimizer_forms_not_read_are_refused(tmp_path):
    import shutil

    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    root = tmp_path / "src"
    shutil.copytree(MEGATRON_LM / "trained_distopt_dp2", root)
    cases = [(lambda sd: setattr(sd["args"], "pipeline_model_parallel_size", 2),
              r"dp_reshardable state \(saved at tp=1 pp=2.*--dist-ckpt-optim-fully-reshardable"),
             (lambda sd: sd["content_metadata"].update(
                 distrib_optim_sharding_type="dp_zero_gather_scatter"),
              r"saved as 'dp_zero_gather_scatter', which megazoo does not read; re-save it with "
              r"Megatron-LM's --dist-ckpt-optim-fully-reshardable")]
    for i, (change, message) in enumerate(cases):
        _rewrite_common(root, change)
        with pytest.raises(CheckpointError, match=message):
            import_checkpoint("megatron-dist", str(root), str(tmp_path / f"refused{i}"))
    # weights only still imports, and --format megatron names the format to use
    import_checkpoint("megatron-dist", str(root), str(tmp_path / "weights"), optimizer=False)
    with pytest.raises(CheckpointError, match="a torch_dist checkpoint .* --format megatron-dist"):
        import_checkpoint("megatron", str(root), str(tmp_path / "legacy"))


def test_megatron_lm_torch_dist_metadata_is_read_through_the_allowlist(tmp_path):
    """DCP's own reader unpickles `.metadata` with no restriction; the import reads Megatron-LM's
    (its save plans included) through safe_load's allowlist and refuses any other class."""
    import collections
    import pickle
    import shutil

    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    for name in ("trained_dist_tp1", "trained_distopt_dp2", "trained_distopt_full_dp2"):
        assert safe_load.dcp_metadata(str(MEGATRON_LM / name / "iter_0000002")).state_dict_metadata
    root = tmp_path / "src"
    shutil.copytree(MEGATRON_LM / "trained_dist_tp1", root)
    (root / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(collections.OrderedDict()))
    with pytest.raises(safe_load.UnsafeCheckpointError,
                       match="holds collections.OrderedDict, outside DCP's metadata classes"):
        import_checkpoint("megatron-dist", str(root), str(tmp_path / "out"))
    # a dotted name inside an allowed module (metadata's own `os`) reaches no further
    command = f"touch {tmp_path / 'ran'}".encode()

    def text(b):
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    (root / "iter_0000002" / ".metadata").write_bytes(
        b"\x80\x04" + text(b"torch.distributed.checkpoint.metadata") + text(b"os.system")
        + b"\x93" + text(command) + b"\x85R.")  # STACK_GLOBAL, (command,), REDUCE
    with pytest.raises(safe_load.UnsafeCheckpointError,
                       match="holds torch.distributed.checkpoint.metadata.os.system, outside"):
        import_checkpoint("megatron-dist", str(root), str(tmp_path / "out"))
    assert not (tmp_path / "ran").exists()
    (root / "iter_0000002" / ".metadata").write_bytes(pickle.dumps([1, 2]))  # no class at all
    with pytest.raises(safe_load.UnsafeCheckpointError, match="holds a list, not DCP's Metadata"):
        import_checkpoint("megatron-dist", str(root), str(tmp_path / "out"))
