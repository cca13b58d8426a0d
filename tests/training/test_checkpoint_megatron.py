"""Megatron-LM legacy checkpoints in and out (training/checkpoint/foreign/), on files written by
the test.

The source (tests/foreign_checkpoints.py) is Megatron-core's own GPTModel after two AdamW
steps, wrapped by the test in the legacy file layout as we read Megatron-LM's
training/checkpointing.py (not written by Megatron-LM: its own files are checked in
test_checkpoint_megatron_golden.py). Checked: imported
at another layout the logits equal Megatron-core's forward within 1e-5, iteration, consumed
samples and Adam moments carry over exactly, `--load` of the import continues the run with
Megatron's next loss, export -> import is bit for bit, TP shards follow Megatron's
[gate_r; up_r], unsafe or inconsistent files are refused, the tools name and convert it.
"""
import os

import pytest
import torch

from tests.foreign_checkpoints import (FP32, LAYERS, PADDED, SEQ, VOCAB, cpu_stubs,
                                       megatron_args, megatron_run, megatron_world,
                                       megazoo_logits, megazoo_resumes_like_megatron,
                                       save_legacy)
from tests.tool_runs import tool_module


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    return megatron_run(tmp_path_factory)


def test_megatron_import_at_another_layout_continues_the_run(megatron):
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    save = str(megatron["tmp"].mktemp("mz"))
    folder = import_checkpoint("megatron", megatron["root"], save, tp=2, pp=2)
    logits = megazoo_logits(folder, megatron["ids"])
    torch.testing.assert_close(logits, megatron["logits"][..., :VOCAB], **FP32)
    full = read_full_state(folder)
    assert full.meta["iteration"] == 7 and full.meta["consumed_samples"] == 56
    assert int(full.scalars["applied_steps"]) == 2 and int(full.scalars["iteration"]) == 7
    assert full.meta["source"]["scheduler"]["lr_decay_style"] == "cosine"
    params = dict(megatron["model"].named_parameters())
    state = megatron["opt"].state
    checked = 0
    for mz, mg in (("layers.1.mlp.fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight"),
                   ("layers.3.attention.qkv.weight", "decoder.layers.3.self_attention.linear_qkv.weight"),
                   ("layers.2.input_norm.weight", "decoder.layers.2.input_layernorm.weight"),
                   ("head_weight", "output_layer.weight")):
        p = params[mg]
        rows = slice(0, VOCAB) if mz == "head_weight" else slice(None)
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optim[s][mz], state[p][s][rows])
        assert torch.equal(full.optim["master"][mz], p.detach()[rows])
        checked += 1
    assert checked == 4
    megatron["imported"] = folder


def test_megatron_export_shards_like_megatron_and_round_trips(megatron):
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    if "imported" not in megatron:
        pytest.fail("needs the import test's checkpoint")
    from megazoo.training.checkpoint import format as ckpt
    out = str(megatron["tmp"].mktemp("mg_out"))
    with pytest.raises(ckpt.CheckpointError, match="only Megatron-DeepSpeed's GPT and BLOOM"):
        export_checkpoint("deepspeed", megatron["imported"], out,  # Llama: no pipeline names
                          universal_names="megatron-deepspeed")
    export_checkpoint("megatron", megatron["imported"], out, tp=2, pp=2, vpp=2)
    rank = safe_load.load(os.path.join(out, "iter_0000007", "mp_rank_00_001", "model_optim_rng.pt"))
    assert sorted(k for k in rank if k.startswith("model")) == ["model0", "model1"]
    # pipeline rank 1 chunk 0 holds layer 1 (local 0); tp rank 0 holds [gate_0; up_0]
    fc1 = megatron["model"].decoder.layers[1].mlp.linear_fc1.weight.detach()
    gate, up = fc1.chunk(2)
    assert torch.equal(rank["model0"]["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[:24], up[:24]]))
    back = str(megatron["tmp"].mktemp("mz_back"))
    folder = import_checkpoint("megatron", out, back, tp=1, pp=1)
    a, b = read_full_state(megatron["imported"]), read_full_state(folder)
    assert set(a.weights) == set(b.weights) and set(a.optim) == set(b.optim) == {
        "master", "exp_avg", "exp_avg_sq"}
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
        for s in a.optim:
            assert torch.equal(a.optim[s][k], b.optim[s][k]), (s, k)
    assert {k: int(v) for k, v in a.scalars.items()} == {k: int(v) for k, v in b.scalars.items()}
    assert b.meta["consumed_samples"] == 56 and b.meta["iteration"] == 7


class _Payload:
    """A class outside the allowlist (pickles like any user object)."""


def test_megatron_unsafe_and_inconsistent_files_are_refused(megatron, tmp_path):
    from megazoo.training.checkpoint.foreign import safe_load
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    bad = tmp_path / "bad.pt"
    torch.save({"args": _Payload()}, bad)
    with pytest.raises(safe_load.UnsafeCheckpointError, match="_Payload"):
        safe_load.load(str(bad))
    args = megatron_args()
    args.num_query_groups = 4  # the saved QKV has 2 groups' rows
    root = str(tmp_path / "mg")
    save_legacy(root, megatron["model"], megatron["opt"], args)
    with pytest.raises(CheckpointError, match=r"qkv.weight has shape \(64, 32\).*give \(96, 32\)"):
        import_checkpoint("megatron", root, str(tmp_path / "out"))


def test_megatron_tools_name_and_convert_the_checkpoint(megatron, tmp_path, capsys):
    assert "Megatron-LM legacy checkpoint (iteration 7): tp=1 pp=1 ep=1 vpp=1, 4 layers" in \
        tool_module("inspect_checkpoint")._foreign(megatron["root"])
    assert "Megatron-core torch_dist checkpoint (iteration 7), saved at tp=1 pp=1" in \
        tool_module("inspect_checkpoint")._foreign(megatron["dist_root"])
    convert = tool_module("convert_checkpoint")
    save = str(tmp_path / "mz")
    assert convert.main(["import", "--format", "megatron", "--load", megatron["root"], "--save",
                         save, "--tensor-model-parallel-size", "2", "--no-optimizer"]) == 0
    from megazoo.training.checkpoint.format import read_meta, resolve
    meta = read_meta(resolve(save))
    assert meta["weights_only"] and meta["layout"]["tp"] == 2 and meta["model"]["family"] == "llama"
    assert convert.main(["export", "--format", "megatron", "--load", save, "--save",
                         str(tmp_path / "mg"), "--pipeline-model-parallel-size", "3"]) == 1
    assert "4 layers do not split over pp=3" in capsys.readouterr().err


def test_megatron_resume_next_loss_equals_megatron_next_loss(megatron):
    """`--load` of the import continues the run: after one more step on each side (Megatron-core
    with torch's AdamW from its saved state; megazoo's optimizer from the imported moments and
    step count), the next losses agree within 1e-4 relative. Megatron's softmax runs over the
    padded vocabulary, so the import keeps the padding rows as tokens (--vocab-size 64)."""
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    save = str(megatron["tmp"].mktemp("mz_resume"))
    import_checkpoint("megatron", megatron["root"], save, tp=2, pp=2, vocab_size=PADDED)
    ids = megatron["ids"]
    # Megatron side: the saved model and AdamW state, one more step
    model = megatron["model"].train()
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                              "params": list(g["params"])} for g in megatron["opt"].param_groups])
    opt.load_state_dict(megatron["opt"].state_dict())  # copies: the saved state stays as it was
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pos = torch.arange(SEQ).expand(2, SEQ)
    with megatron_world(), cpu_stubs():
        loss = model(ids, pos, attention_mask=mask, labels=ids).float().mean()
        first = loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            want = model(ids, pos, attention_mask=mask, labels=ids).float().mean().item()
            for n, p in model.named_parameters():
                p.copy_(kept[n])
    model.eval()
    # megazoo side: --load the import (tp=2, pp=2) at tp=1, one step with the same batch
    flags = ["--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
             "--seq-length", str(SEQ), "--max-position-embeddings", "32", "--vocab-size",
             str(PADDED), "--make-vocab-size-divisible-by", "16", "--mock-data",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2",
             "--lr-decay-style", "constant", "--weight-decay", "0.01", "--clip-grad", "0",
             "--adam-eps", "1e-8", "--train-iters", "10", "--load", save,
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
    run = to_run_config(build_parser().parse_args(flags), world_size=1)
    state = megazoo_resumes_like_megatron(run, ids, first, want)
    assert (state.iteration, state.consumed_samples) == (7, 56)
