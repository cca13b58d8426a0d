"""DeepSpeed checkpoints in and out (training/checkpoint/foreign/deepspeed.py).

Megatron-DeepSpeed's pipeline layer files (as BLOOM-176B was saved) and its universal
checkpoints are written here by hand from their formats, around random `transformers` models
(Megatron-DeepSpeed is a training repository, not a package the tests install). The ZeRO files
written by hand here add what DeepSpeed's own files in test_checkpoint_deepspeed_engine.py lack:
two parameter groups and GPT-2's Conv1D layout; that module runs DeepSpeed 0.19.8's engine
itself. Checked: the logits equal the Hugging Face model's within 1e-5, masters, moments and steps carry over exactly, TP copies that drifted
apart are averaged with one warning, and universal checkpoints are exported and read back
bit for bit.
"""
import argparse
import os

import pytest
import torch

from tests.foreign_checkpoints import FP32, SEQ, megazoo_logits
from tests.tool_runs import tool_module


def _bloom_layer_files(folder, hf, tp, padded, drift):
    """Megatron-DeepSpeed's pipeline layout of a Hugging Face BLOOM, as BLOOM-176B was saved:
    written by hand from the format (layer 1 the embedding, 3.. the blocks, L+4 the final norm;
    Hugging Face's BLOOM converter reads the same names and splits). `drift` is added to rank
    0's and taken from rank 1's copy of one norm."""
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    L = hf.config.n_layer
    row = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
    col = ("query_key_value", "dense_h_to_4h")

    def part(key, t, rank):
        if key.endswith(row):
            return t.chunk(tp, 1)[rank].clone()
        if any(c in key for c in col):
            return t.chunk(tp, 0)[rank].clone()
        return t.clone()

    for rank in range(tp):
        emb = torch.cat([sd["word_embeddings.weight"],
                         torch.zeros(padded - VOCAB_BLOOM, hf.config.hidden_size)])
        layers = {1: {"word_embeddings.weight": emb.chunk(tp)[rank].clone(),
                      "word_embeddings.norm.weight": sd["word_embeddings_layernorm.weight"].clone(),
                      "word_embeddings.norm.bias": sd["word_embeddings_layernorm.bias"].clone()},
                  L + 4: {"weight": sd["ln_f.weight"].clone(), "bias": sd["ln_f.bias"].clone()}}
        for i in range(L):
            block = {k[len(f"h.{i}."):]: part(k, v, rank) for k, v in sd.items()
                     if k.startswith(f"h.{i}.")}
            layers[3 + i] = block
        layers[3]["input_layernorm.weight"] += drift if rank == 0 else -drift
        for number, tensors in layers.items():
            torch.save(tensors, os.path.join(folder, f"layer_{number:02d}-model_{rank:02d}-model_states.pt"))


VOCAB_BLOOM = 101


@pytest.fixture(scope="module")
def bloom():
    """A random `transformers` BLOOM and the Megatron-DeepSpeed args that describe it, with
    Megatron-DeepSpeed's own position enum (pickled under its module path)."""
    import enum
    import types
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=VOCAB_BLOOM, hidden_size=48, n_layer=3, n_head=4,
                                      hidden_dropout=0, attention_dropout=0)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    fake = types.ModuleType("megatron.enums")
    fake.PositionEmbeddingType = enum.Enum("PositionEmbeddingType", "rotary absolute alibi",
                                           module="megatron.enums")
    args = argparse.Namespace(
        num_layers=3, hidden_size=48, ffn_hidden_size=192, num_attention_heads=4,
        padded_vocab_size=112, make_vocab_size_divisible_by=8, seq_length=64,
        max_position_embeddings=64, position_embedding_type=fake.PositionEmbeddingType.alibi,
        embed_layernorm=True, bias_gelu_fusion=True, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, consumed_train_samples=96)
    ids = torch.randint(0, VOCAB_BLOOM, (2, SEQ))
    with torch.no_grad():
        logits = hf(ids).logits
    return dict(hf=hf, args=args, enum_module=fake, ids=ids, logits=logits)


def _save_model_states(folder, bloom, tp=2):
    import sys
    sys.modules["megatron.enums"] = bloom["enum_module"]
    try:
        for rank in range(tp):
            torch.save({"args": bloom["args"], "iteration": 12, "module": None},
                       os.path.join(folder, f"mp_rank_{rank:02d}_model_states.pt"))
    finally:
        del sys.modules["megatron.enums"]


def test_deepspeed_bloom_pipeline_layout_imports_with_drift_averaged(bloom, tmp_path, caplog):
    import logging
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    folder = tmp_path / "bloom" / "global_step12"
    folder.mkdir(parents=True)
    (tmp_path / "bloom" / "latest").write_text("global_step12")
    _bloom_layer_files(str(folder), bloom["hf"], tp=2, padded=112, drift=1e-3)
    _save_model_states(str(folder), bloom)
    with caplog.at_level(logging.WARNING):
        out = import_checkpoint("deepspeed", str(tmp_path / "bloom"), str(tmp_path / "mz"), tp=1,
                                vocab_size=VOCAB_BLOOM)
    drift_lines = [r.getMessage() for r in caplog.records if "largest drift" in r.getMessage()]
    assert len(drift_lines) == 1 and "layers.0.input_norm.weight" in drift_lines[0]
    assert "0.002" in drift_lines[0]
    torch.testing.assert_close(megazoo_logits(out, bloom["ids"]), bloom["logits"], **FP32)
    line = tool_module("inspect_checkpoint")._foreign(str(tmp_path / "bloom"))
    assert "DeepSpeed pipeline-layer checkpoint (Megatron-DeepSpeed, global_step12): 5 layer files x tp=2" in line


def _pipeline_name(hf_name, layers):
    """Megatron-DeepSpeed's pipeline-module name of a HF BLOOM tensor (layer 1 the tied
    embedding, 3.. the blocks, layers + 4 the final norm)."""
    name = hf_name.removeprefix("transformer.")
    if name.startswith("word_embeddings_layernorm."):
        return "tied_modules.embed.word_embeddings.norm." + name.rsplit(".", 1)[1]
    if name.startswith("word_embeddings."):
        return "tied_modules.embed." + name
    if name.startswith("ln_f."):
        return f"{layers + 4}." + name[len("ln_f."):]
    _, i, rest = name.split(".", 2)
    return f"{int(i) + 3}.{rest}"


def test_deepspeed_universal_checkpoint_resumes_with_its_moments(bloom, tmp_path):
    """A universal checkpoint written by hand from DeepSpeed's ds_to_universal.py format
    (Megatron-DeepSpeed's pipeline names): fp32 masters, moments and step carry over.
    Exported back (the files of universal_checkpoint.py's loader: `param`, `cat_dim`,
    `vocab_tensor`, step.pt, latest_universal) it imports bit for bit."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    folder = tmp_path / "ds" / "global_step12"
    (folder / "zero").mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step12")
    _save_model_states(str(folder), bloom)
    g = torch.Generator().manual_seed(3)
    moments = {}
    layers = bloom["hf"].config.n_layer
    for hf_name, p in bloom["hf"].state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        d = folder / "zero" / _pipeline_name(hf_name, layers)
        d.mkdir()
        m = (torch.randn(p.shape, generator=g), torch.rand(p.shape, generator=g))
        moments[hf_name] = m
        torch.save({"param": p.detach().clone()}, d / "fp32.pt")
        torch.save({"param": m[0]}, d / "exp_avg.pt")
        torch.save({"param": m[1]}, d / "exp_avg_sq.pt")
        torch.save(torch.tensor(5), d / "step.pt")
    out = import_checkpoint("deepspeed", str(tmp_path / "ds"), str(tmp_path / "mz"), tp=2,
                            vocab_size=VOCAB_BLOOM)
    torch.testing.assert_close(megazoo_logits(out, bloom["ids"]), bloom["logits"], **FP32)
    full = read_full_state(out)
    assert int(full.scalars["applied_steps"]) == 5 and full.meta["iteration"] == 12
    assert full.meta["consumed_samples"] == 96
    for mz, hf_name in (("layers.1.attention.qkv.weight", "transformer.h.1.self_attention.query_key_value.weight"),
                        ("embedding.norm.bias", "transformer.word_embeddings_layernorm.bias"),
                        ("layers.2.mlp.fc2.weight", "transformer.h.2.mlp.dense_4h_to_h.weight")):
        assert torch.equal(full.optim["exp_avg"][mz], moments[hf_name][0])
        assert torch.equal(full.optim["exp_avg_sq"][mz], moments[hf_name][1])
    assert "DeepSpeed universal checkpoint (global_step12)" in \
        tool_module("inspect_checkpoint")._foreign(str(tmp_path / "ds"))
    # export: the universal layout DeepSpeed's loader reads, and back bit for bit
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint
    export_checkpoint("deepspeed", out, str(tmp_path / "ds_out"))
    assert (tmp_path / "ds_out" / "latest_universal").read_text() == "global_step12"
    zero = tmp_path / "ds_out" / "global_step12" / "zero"
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == \
        sorted(p.name for p in (folder / "zero").iterdir())
    emb = torch.load(zero / "tied_modules.embed.word_embeddings.weight" / "exp_avg.pt", weights_only=True)
    assert emb["cat_dim"] == 0 and emb["vocab_tensor"] is True
    assert torch.equal(emb["param"], moments["transformer.word_embeddings.weight"][0])
    dense = torch.load(zero / "4.self_attention.dense.weight" / "fp32.pt", weights_only=True)
    norm = torch.load(zero / "3.input_layernorm.bias" / "fp32.pt", weights_only=True)
    assert dense["cat_dim"] == 1 and "cat_dim" not in norm
    assert int(torch.load(zero / "5.mlp.dense_h_to_4h.weight" / "step.pt", weights_only=True)) == 5
    back = read_full_state(import_checkpoint("deepspeed", str(tmp_path / "ds_out"),
                                             str(tmp_path / "mz_back")))
    assert set(back.weights) == set(full.weights) and back.meta["consumed_samples"] == 96
    for k in full.weights:
        assert torch.equal(back.weights[k], full.weights[k]), k
        for s in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(back.optim[s][k], full.optim[s][k]), (s, k)
    assert int(back.scalars["applied_steps"]) == 5 and back.meta["iteration"] == 12
    import shutil  # the pipeline layer files (the module's weights) read alone: the same model
    shutil.rmtree(zero)
    layers = read_full_state(import_checkpoint("deepspeed", str(tmp_path / "ds_out"),
                                               str(tmp_path / "mz_layers"), optimizer=False))
    assert all(torch.equal(layers.weights[k], full.weights[k]) for k in full.weights)


def _zero_files(folder, hf, stage, world, moments, zero_stage_enum):
    """DeepSpeed ZeRO-`stage` files of a Hugging Face model over `world` data-parallel ranks,
    written by hand from DeepSpeed's format (stage_1_and_2.py / stage3.py state dicts, as
    zero_to_fp32.py reads them): two parameter groups (weight decay, none)."""
    from collections import OrderedDict
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    groups = [[(n, p) for n, p in named if p.dim() > 1], [(n, p) for n, p in named if p.dim() == 1]]
    shapes = [OrderedDict((n, p.shape) for n, p in g) for g in groups]
    record = {"module": hf.state_dict() if stage < 3 else {}, "param_shapes": shapes,
              "global_steps": 9, "global_samples": 72, "ds_version": "0.19.8"}
    # ZeRO-3 writes one model-state file per data-parallel rank and no mp_rank_00 file
    for name in (["mp_rank_00_model_states.pt"] if stage < 3 else
                 [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]):
        torch.save(record, os.path.join(folder, name))

    def partitions(tensors):
        """Per rank, this group's flat piece."""
        if stage < 3:  # the group's concatenation split evenly, padding removed
            flat = torch.cat([t.reshape(-1) for t in tensors])
            part = -(-flat.numel() // world)
            return [flat[r * part:(r + 1) * part] for r in range(world)]
        pieces = [[] for _ in range(world)]  # every parameter split on its own, padded
        for t in tensors:
            part = -(-t.numel() // world)
            padded = torch.cat([t.reshape(-1), t.new_zeros(part * world - t.numel())])
            for r in range(world):
                pieces[r].append(padded[r * part:(r + 1) * part])
        return [torch.cat(p) for p in pieces]

    per_group = []
    for g in groups:
        per_group.append({s: partitions([src[n] for n, _ in g]) for s, src in (
            ("fp32", {n: p for n, p in g}), ("exp_avg", moments[0]), ("exp_avg_sq", moments[1]))})
    for r in range(world):
        state = {i: {"step": torch.tensor(9.0), "exp_avg": pg["exp_avg"][r],
                     "exp_avg_sq": pg["exp_avg_sq"][r]} for i, pg in enumerate(per_group)}
        adam = {"state": state, "param_groups": [{"params": [i]} for i in range(len(groups))]}
        osd = {"zero_stage": zero_stage_enum(stage), "partition_count": world,
               "loss_scaler": None, "overflow": False}
        if stage < 3:
            osd.update(base_optimizer_state=adam,
                       single_partition_of_fp32_groups=[pg["fp32"][r] for pg in per_group])
        else:
            osd.update(optimizer_state_dict=adam,
                       fp32_flat_groups=[pg["fp32"][r] for pg in per_group])
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                   os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_checkpoint_imports_masters_and_moments(stage, tmp_path):
    import enum
    import sys
    import types
    from transformers import GPT2Config, GPT2LMHeadModel
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.reshard import read_full_state
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_BLOOM, n_positions=32, n_embd=32, n_layer=2,
                                    n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    hf.config.save_pretrained(str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(4)
    moments = [{n: torch.randn(p.shape, generator=g) for n, p in hf.named_parameters()},
               {n: torch.rand(p.shape, generator=g) for n, p in hf.named_parameters()}]
    folder = tmp_path / "ds" / "global_step9"
    folder.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step9")
    # DeepSpeed's own ZeroStageEnum, pickled under its module path
    path = "deepspeed.runtime.zero.config"
    fakes = {p: types.ModuleType(p) for p in ("deepspeed", "deepspeed.runtime",
                                              "deepspeed.runtime.zero", path)}
    fakes[path].ZeroStageEnum = enum.IntEnum("ZeroStageEnum", "optimizer_states gradients weights",
                                             module=path)
    sys.modules.update(fakes)
    try:
        _zero_files(str(folder), hf, stage, 2, moments, fakes[path].ZeroStageEnum)
    finally:
        for p in fakes:
            del sys.modules[p]
    assert f"DeepSpeed ZeRO-{stage} checkpoint (global_step9): 2 data-parallel ranks" in \
        tool_module("inspect_checkpoint")._foreign(str(tmp_path / "ds"))
    out = import_checkpoint("deepspeed", str(tmp_path / "ds"), str(tmp_path / "mz"), tp=2,
                            hf_config=str(tmp_path / "hf"))
    ids = torch.randint(0, VOCAB_BLOOM, (2, SEQ))
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(megazoo_logits(out, ids), want, **FP32)
    full = read_full_state(out)
    assert int(full.scalars["applied_steps"]) == 9 and full.meta["consumed_samples"] == 72
    for mz, name in (("layers.1.input_norm.weight", "transformer.h.1.ln_1.weight"),
                     ("embedding.word_embeddings.weight", "transformer.wte.weight"),
                     ("layers.0.mlp.fc2.weight", "transformer.h.0.mlp.c_proj.weight")):
        t = (lambda x: x.t()) if mz.endswith("fc2.weight") else (lambda x: x)  # GPT-2's Conv1D
        assert torch.equal(full.optim["exp_avg"][mz], t(moments[0][name]))
        assert torch.equal(full.optim["exp_avg_sq"][mz], t(moments[1][name]))
    # model-state records of another model: a group's flat buffer left over is refused
    for path in folder.glob("*model_states.pt"):
        record = torch.load(path, weights_only=True)
        record["param_shapes"][1].popitem()
        torch.save(record, path)
    with pytest.raises(CheckpointError, match=r"param_shapes account for \d+; the files disagree"):
        import_checkpoint("deepspeed", str(tmp_path / "ds"), str(tmp_path / "mz_bad"),
                          hf_config=str(tmp_path / "hf"))


def test_deepspeed_trainer_output_folder_and_frozen_parameters_are_refused(tmp_path):
    """A Hugging Face Trainer output folder (checkpoint-N folders, no `latest`) names the newest
    checkpoint to pass; a ZeRO run with frozen parameters (no masters nor moments for them) is
    refused with the optimizer by its model-state file, before the optimizer files are read."""
    from collections import OrderedDict
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    from tests.deepspeed_engine import llama_config
    run = tmp_path / "trainer_out"
    for step in (500, 1000):
        (run / f"checkpoint-{step}" / f"global_step{step}").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"Hugging Face Trainer output folder holding "
                                              r"checkpoint-500, checkpoint-1000; pass one of them, "
                                              r"e\.g\. .*trainer_out/checkpoint-1000"):
        import_checkpoint("deepspeed", str(run), str(tmp_path / "mz"))
    folder = tmp_path / "frozen" / "global_step3"
    folder.mkdir(parents=True)
    (tmp_path / "frozen" / "latest").write_text("global_step3")
    torch.save({"param_shapes": [OrderedDict(w=torch.Size([4, 4]))],
                "frozen_param_shapes": OrderedDict(v=torch.Size([4]))},
               folder / "mp_rank_00_model_states.pt")
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not read")
    llama_config().save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: 1 parameters were "
                                              r"not trained \(frozen_param_shapes, e\.g\. v\).*"
                                              r"--no-optimizer"):
        import_checkpoint("deepspeed", str(tmp_path / "frozen"), str(tmp_path / "mz"),
                          hf_config=str(tmp_path / "hf"))


def test_deepspeed_loss_scale_continues_in_megazoos_scaler(tmp_path, monkeypatch, caplog):
    """DeepSpeed's own DynamicLossScaler after several histories (fresh, clean steps, overflows,
    growths), saved and read back as its optimizer files hold it (through the stand-ins), set into
    megazoo's DynamicLossScaler: over the next clean steps and then overflows both take the same
    scale at every step. Static scalers (fp32 and bf16 runs' scale 1, a fixed fp16 scale) carry no
    state; a fixed scale other than 1 is logged with its flag."""
    import logging
    from deepspeed.runtime.fp16 import loss_scaler as ds
    from megazoo.parallel.zero.config import LossScaleConfig
    from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.deepspeed_loss_scale import scaler_scalars
    monkeypatch.setattr(ds.dist, "get_rank", lambda: 0)  # its overflow message asks for the rank

    def saved(scaler):
        torch.save({"loss_scaler": scaler}, tmp_path / "optim.pt")
        return safe_load.load(str(tmp_path / "optim.pt"))

    window, clean, overflow = 3, False, True
    histories = [[], [clean] * 2, [clean] * 3, [clean] * 4, [overflow], [overflow, clean],
                 [clean] * 2 + [overflow] + [clean] * 4, [overflow] * 3, [clean] * 7]
    for history in histories:
        theirs = ds.DynamicLossScaler(init_scale=2.0 ** 16, scale_window=window, min_scale=1,
                                      delayed_shift=2, consecutive_hysteresis=False)
        for step in history:
            theirs.update_scale(step)
        state = scaler_scalars(saved(theirs), "optim.pt")
        ours = DynamicLossScaler(LossScaleConfig(growth_interval=window, hysteresis=2))
        ours.load_state_dict({k.removeprefix("scaler."): v for k, v in state.items()})
        for step in [clean] * (2 * window + 2) + [overflow] * 3:
            theirs.update_scale(step)
            ours.update(step)
            assert ours.scale == theirs.cur_scale, (history, step)
    with caplog.at_level(logging.INFO):
        assert scaler_scalars(saved(ds.LossScaler(1)), "fp32") == {}
        assert scaler_scalars(saved(ds.LossScaler(128)), "static") == {}
    assert "static loss scale 128; resume with --fp16 --loss-scale 128" in caplog.text
