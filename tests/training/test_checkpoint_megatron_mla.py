"""Megatron-core checkpoints with multi-latent attention (YaRN), Llama-3.1 RoPE scaling, partial
RoPE and squared ReLU, in legacy and torch_dist form, imported at tp=2 pp=2 with Megatron-core's
own logits; dense MLA exported back for Megatron-core.

The models are Megatron-core's GPTModel (tests/foreign_megatron_variants.py), the legacy file
written as Megatron-LM lays it out and the torch_dist folder by Megatron-core's own
`dist_checkpointing.save`. Logits cover positions 0..15, twice YaRN's original length 8, and each
scaling is shown to matter: the same weights without it give other logits.
"""
import os

import pytest
import torch

from tests.foreign_checkpoints import (FP32, VOCAB, cpu_stubs, megatron_world, megazoo_logits,
                                       save_dist, save_legacy)
from tests.foreign_megatron_variants import (SEQ, VARIANTS, adam_step, build, logits,
                                             mtp_losses)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Every variant built once in one Megatron-core world: its logits and checkpoints."""
    import megatron.core  # noqa: F401 - installed by the dev extra
    import warnings
    warnings.filterwarnings("ignore", module="megatron")
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    runs = {}
    with megatron_world(), cpu_stubs():
        for seed, name in enumerate(VARIANTS):
            model, args = build(name, seed)
            opt = adam_step(model, ids) if name == "mla_yarn" else None
            root = str(tmp_path_factory.mktemp(name))
            dist_root = str(tmp_path_factory.mktemp(name + "_dist"))
            if opt is not None:
                save_legacy(root, model, opt, args, iteration=5)
            else:
                save_legacy(root, model, None, args, iteration=5, optimizer_state={})
            save_dist(dist_root, model, args, iteration=5)
            runs[name] = dict(model=model, args=args, opt=opt, root=root, dist_root=dist_root)
            if name == "mla_mtp":  # Megatron-core's MTP forward needs labels: its losses
                runs[name]["losses"] = mtp_losses(model, ids, labels)
            else:
                runs[name]["logits"] = logits(model, ids)[..., :VOCAB]
    return dict(runs=runs, ids=ids, labels=labels, tmp=tmp_path_factory)


def _logits_with(folder, ids, **changes):
    """The imported weights under the same config with `changes` (a scaling taken away)."""
    from megazoo.training.checkpoint.hf import checkpoint_config
    from megazoo.training.checkpoint.layout_writer import build_rank_chunks
    from megazoo.training.checkpoint.reshard import load_weights
    _, config = checkpoint_config(folder)
    topo, chunks = build_rank_chunks(config.replace(**changes), tp=1, pp=1, vpp=1, dp=1, rank=0)
    load_weights(folder, chunks, topo)
    with torch.no_grad():
        return chunks[0].eval()(ids)[..., :VOCAB]


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "mla_mtp"])
def test_megatron_variant_imports_with_megatron_logits(megatron, name):
    """Legacy and torch_dist -> megazoo tp=2 pp=2: the config says what Megatron ran (MLA with
    and without a query latent, YaRN and its mscales, Llama 3.1's scaling, relu^2), the logits
    are Megatron-core's; without the scaling they are not."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.hf import checkpoint_config
    run, ids, tmp = megatron["runs"][name], megatron["ids"], megatron["tmp"]
    checked = []
    for fmt, root in (("megatron", run["root"]), ("megatron-dist", run["dist_root"])):
        folder = import_checkpoint(fmt, root, str(tmp.mktemp(f"mz_{name}")), tp=2, pp=2,
                                   optimizer=False)
        torch.testing.assert_close(megazoo_logits(folder, ids), run["logits"], **FP32)
        checked.append(fmt)
    _, config = checkpoint_config(folder)
    kind = (config.rope_scaling or {}).get("rope_type")
    assert kind == {"mla_yarn": "yarn", "mla_no_q_lora": "yarn", "llama3": "llama3"}.get(name)
    if name.startswith("mla"):
        assert config.family == "deepseek_v3" and config.num_experts is None
        assert config.q_lora_rank == (24 if name == "mla_yarn" else None)
        assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                config.v_head_dim) == (16, 8, 4, 8)
    elif name == "relu2":
        assert (config.family, config.activation) == ("gpt2", "relu2")
    elif name == "partial_rotary":
        assert (config.family, config.rotary_fraction) == ("llama", 0.5)
    # the scaling (or partial RoPE) changes the logits by far more than the tolerance
    changes = dict(rope_scaling=None) if kind else dict(rotary_fraction=1.0) \
        if name == "partial_rotary" else None
    if changes:
        diff = (_logits_with(folder, ids, **changes) - run["logits"]).abs().max().item()
        assert diff > 1e-3, diff
        checked.append(changes)
    assert len(checked) == 2 + bool(changes)


def test_megatron_mtp_imports_and_exports_with_megatron_losses(megatron):
    """MLA with one MTP depth (Megatron-core's MultiTokenPredictionLayer), legacy and torch_dist
    -> megazoo tp=2 pp=2: the main per-token loss and the depth's loss equal Megatron-core's
    training forward's (vocabulary kept padded: Megatron's softmax includes the padding rows);
    exported back (legacy at pp=1, torch_dist), Megatron-core loads it with the same losses."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.hf import checkpoint_config
    from megazoo.training.checkpoint.layout_writer import build_rank_chunks
    from megazoo.training.checkpoint.reshard import load_weights
    from tests.foreign_checkpoints import PADDED
    run, tmp = megatron["runs"]["mla_mtp"], megatron["tmp"]
    main, depths = run["losses"]
    checked = []
    for fmt, root in (("megatron", run["root"]), ("megatron-dist", run["dist_root"])):
        folder = import_checkpoint(fmt, root, str(tmp.mktemp("mz_mtp")), tp=2, pp=2,
                                   optimizer=False, vocab_size=PADDED)
        _, config = checkpoint_config(folder)
        assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (1, 0.3)
        topo, chunks = build_rank_chunks(config, tp=1, pp=1, vpp=1, dp=1, rank=0)
        load_weights(folder, chunks, topo)
        model = chunks[0].train()  # no dropout: training mode records the depth's loss
        with torch.no_grad():
            per_token = model(megatron["ids"], labels=megatron["labels"])
        torch.testing.assert_close(per_token, main, **FP32)
        torch.testing.assert_close(model.mtp.stats.totals[1:].float(), depths, **FP32)
        assert model.mtp.stats.totals[0] == 1
        checked.append(fmt)
    # and back: legacy (pp=1) and torch_dist that Megatron-core loads with the same losses
    import argparse
    from megatron.core import dist_checkpointing
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint
    legacy = export_checkpoint("megatron", folder, str(tmp.mktemp("mtp_out")))
    sd = safe_load.load(os.path.join(legacy, "mp_rank_00", "model_optim_rng.pt"))
    assert (sd["args"].mtp_num_layers, sd["args"].mtp_loss_scaling_factor) == (1, 0.3)
    dist = export_checkpoint("megatron-dist", folder, str(tmp.mktemp("mtp_dist_out")))
    source = run["model"]
    with megatron_world(), cpu_stubs():
        kept = _load_into(source, sd["model"])
        again = mtp_losses(source, megatron["ids"], megatron["labels"])
        torch.testing.assert_close(again[0], main, **FP32)
        torch.testing.assert_close(again[1], depths, **FP32)
        with torch.no_grad():
            for p in source.parameters():
                p.zero_()
        with torch.serialization.safe_globals([argparse.Namespace]):
            _load_into(source, dist_checkpointing.load(source.sharded_state_dict(), dist))
        again = mtp_losses(source, megatron["ids"], megatron["labels"])
        torch.testing.assert_close(again[0], main, **FP32)
        torch.testing.assert_close(again[1], depths, **FP32)
        source.load_state_dict(kept)
    checked += ["legacy out", "torch_dist out"]
    with pytest.raises(ckpt.CheckpointError, match="export at pp=1"):
        export_checkpoint("megatron", folder, str(tmp.mktemp("mtp_pp2")), pp=2)
    assert len(checked) == 4


def test_megatron_mla_optimizer_state_carries_over(megatron, tmp_path):
    """The legacy file's AdamW moments and step land on megazoo's MLA names."""
    from megazoo.training.checkpoint.foreign import megatron_legacy, names
    run = megatron["runs"]["mla_yarn"]
    _, config, full, it = megatron_legacy.read(run["root"])
    assert it == 5 and int(full.scalars["applied_steps"]) == 1
    state, checked = run["opt"].state, 0
    for key, p in run["model"].named_parameters():
        canon, split, _ = names.to_megazoo(key, 0)
        canon = "head_weight" if key == "output_layer.weight" else canon
        rows = slice(0, VOCAB) if split == "vocab" else slice(None)
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optim[s][canon], state[p][s][rows]), (key, s)
        checked += 1
    assert checked == len(list(run["model"].parameters())) > 15


def test_megatron_unmodelled_settings_refused_in_one_line(megatron):
    """What megazoo does not model stops before any weight is read, naming the argument."""
    import argparse
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.foreign import megatron_args
    base = megatron["runs"]["mla_yarn"]["args"]
    cases = {"qk_layernorm": False, "rope_type": "longrope", "mla_down_proj_fusion": True}
    for arg, value in cases.items():
        args = argparse.Namespace(**vars(base))
        setattr(args, arg, value)
        with pytest.raises(ckpt.CheckpointError, match=f"args.{arg}="):
            megatron_args.to_config(args, "ckpt")
    plain = megatron["runs"]["llama3"]["args"]
    for arg, value in (("rotary_percent", 0.3), ("rotary_interleaved", True),
                       ("rotary_seq_len_interpolation_factor", 2),
                       ("apply_residual_connection_post_layernorm", True),
                       ("quick_geglu", True)):
        args = argparse.Namespace(**vars(plain))
        setattr(args, arg, value)
        with pytest.raises(ckpt.CheckpointError, match=f"args.{arg}="):
            megatron_args.to_config(args, "ckpt")
    # linear position interpolation alone maps to transformers' "linear"
    args = argparse.Namespace(**vars(plain))
    args.use_rope_scaling, args.rotary_seq_len_interpolation_factor = False, 4
    assert megatron_args.to_config(args, "ckpt")[1].rope_scaling == {"rope_type": "linear",
                                                                    "factor": 4.0}


def _load_into(model, state):
    """Megatron-core's model with `state`'s weights (its own keys only); the previous weights."""
    kept = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    return kept


def test_megatron_mla_exports_for_megatron_core(megatron):
    """megazoo's MLA model -> legacy (tp=1) that Megatron-core's GPTModel loads with
    load_state_dict, and torch_dist that its dist_checkpointing.load reads: equal logits; legacy
    at tp=2 pp=2 (down-projections column-split as the local spec) read back bit for bit, with
    the optimizer state. The Llama 3.1 scaling's args round-trip too."""
    import argparse
    from megatron.core import dist_checkpointing
    from megazoo.training.checkpoint.foreign import megatron_args, safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    from tests.foreign_megatron_variants import logits as megatron_logits
    run, ids, tmp = megatron["runs"]["mla_yarn"], megatron["ids"], megatron["tmp"]
    folder = import_checkpoint("megatron", run["root"], str(tmp.mktemp("mla_mz")), tp=2)
    model, checked = run["model"], []
    legacy = export_checkpoint("megatron", folder, str(tmp.mktemp("mla_out")), tp=1)
    sd = safe_load.load(os.path.join(legacy, "mp_rank_00", "model_optim_rng.pt"))
    from megazoo.training.checkpoint.hf import checkpoint_config
    assert megatron_args.to_config(sd["args"], "export")[1].computed_fields() == \
        checkpoint_config(folder)[1].computed_fields()  # YaRN and its mscales written back
    with megatron_world(), cpu_stubs():
        kept = _load_into(model, sd["model"])
        assert torch.equal(megatron_logits(model, ids)[..., :VOCAB], run["logits"])
        checked.append("legacy")
        out = export_checkpoint("megatron-dist", folder, str(tmp.mktemp("mla_dist_out")))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
        _load_into(model, loaded)
        assert torch.equal(megatron_logits(model, ids)[..., :VOCAB], run["logits"])
        checked.append("torch_dist")
        model.load_state_dict(kept)
    split = export_checkpoint("megatron", folder, str(tmp.mktemp("mla_tp2")), tp=2, pp=2)
    rank = safe_load.load(os.path.join(split, "mp_rank_01_001", "model_optim_rng.pt"))["model"]
    down = model.decoder.layers[1].self_attention.linear_q_down_proj.weight.detach()
    assert torch.equal(rank["decoder.layers.0.self_attention.linear_q_down_proj.weight"], down[12:])
    a, b = read_full_state(folder), read_full_state(import_checkpoint(
        "megatron", os.path.dirname(split), str(tmp.mktemp("mla_back"))))
    assert set(a.weights) == set(b.weights) and int(b.scalars["applied_steps"]) == 1
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
        for s in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.optim[s][k], b.optim[s][k]), (s, k)
    checked.append("tp2 pp2")
    llama = megatron["runs"]["llama3"]
    mz = import_checkpoint("megatron", llama["root"], str(tmp.mktemp("l3")), optimizer=False)
    out = export_checkpoint("megatron", mz, str(tmp.mktemp("l3_out")))
    args = safe_load.load(os.path.join(out, "mp_rank_00", "model_optim_rng.pt"))["args"]
    assert (args.use_rope_scaling, args.rope_scaling_factor) == (True, 8.0)
    assert megatron_args.to_config(args, "l3")[1].rope_scaling == \
        megatron_args.to_config(llama["args"], "l3")[1].rope_scaling
    checked.append("llama3 args")
    # YaRN with mscale but no mscale_all_dim (imported as an attention_factor) goes back as the
    # Megatron mscale giving that factor
    other = megatron["runs"]["mla_no_q_lora"]
    mz = import_checkpoint("megatron", other["root"], str(tmp.mktemp("nq")), optimizer=False)
    out = export_checkpoint("megatron", mz, str(tmp.mktemp("nq_out")))
    sd = safe_load.load(os.path.join(out, "mp_rank_00", "model_optim_rng.pt"))
    assert abs(sd["args"].mscale - 0.7) < 1e-12 and sd["args"].mscale_all_dim == 0.0
    with megatron_world(), cpu_stubs():
        kept = _load_into(other["model"], sd["model"])
        torch.testing.assert_close(megatron_logits(other["model"], ids)[..., :VOCAB],
                                   other["logits"], **FP32)
        other["model"].load_state_dict(kept)
    checked.append("yarn mscale")
    assert len(checked) == 5
