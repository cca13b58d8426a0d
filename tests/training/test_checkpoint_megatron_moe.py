"""Megatron-LM MoE runs in and out: Qwen2-MoE (gated shared expert), DeepSeek-V3-style MoE layers
(sigmoid routing, expert bias, groups, scaling, shared expert, first layer dense) and Qwen3-MoE
(q/k norms, legacy GroupedMLP), built by megatron-core 0.16.1's own GPTModel on the CPU
(tests/foreign_moe_checkpoints.py). The torch_dist files are written by megatron-core's
`dist_checkpointing.save`; the legacy files are its state dicts in Megatron-LM's file layout
(written by the test). Imported at tp=2, ep=2 (pp=2 where the layers split evenly), megazoo's
logits equal megatron-core's forward within 1e-5, and so do the legacy files of megatron-core's
own tp=2 and ep=2 models (a 2-process world); the trained run's Adam moments carry over
exactly; an uneven tp1/pp2 legacy file imports; what does not map is refused in one line;
megatron-core loads megazoo's exports with equal logits.
"""
import copy

import pytest
import torch

from tests.foreign_checkpoints import FP32, megazoo_logits, megazoo_resumes_like_megatron
from tests.foreign_moe_checkpoints import SHAPES, moe_runs, save_uneven

FAMILY = {"qwen2_moe": "qwen2_moe", "deepseek": "deepseek_v3", "qwen3_moe": "qwen3_moe"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return moe_runs(tmp_path_factory)


def test_megatron_moe_shapes_import_with_megatron_core_logits(moe):
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    checked = []
    for shape, run in moe["runs"].items():
        pp = 2 if SHAPES[shape]["num_layers"] % 2 == 0 else 1
        for fmt, root in (("megatron", run["root"]), ("megatron-dist", run["dist_root"])):
            folder = import_checkpoint(fmt, root, str(moe["tmp"].mktemp(f"mz_{shape}")),
                                       tp=2, ep=2, pp=pp)
            full = read_full_state(folder)
            assert full.meta["model"]["family"] == FAMILY[shape], (shape, fmt)
            logits = megazoo_logits(folder, moe["ids"])
            torch.testing.assert_close(logits, run["logits"], **FP32)
            checked.append((shape, fmt, (logits - run["logits"]).abs().max().item()))
            run.setdefault("imported", {})[fmt] = folder
    assert len(checked) == 6
    deepseek = read_full_state(moe["runs"]["deepseek"]["imported"]["megatron"])
    cfg = deepseek.meta["model"]
    assert (cfg["moe_first_dense_layers"], cfg["moe_layer_freq"], cfg["moe_router_num_groups"],
            cfg["moe_router_group_topk"], cfg["moe_router_topk_scaling_factor"],
            cfg["moe_norm_topk_prob"]) == (1, 1, 2, 1, 2.5, True)
    model = moe["runs"]["deepseek"]["model"]
    for i in (1, 2):  # the buffer, fp32, as megatron-core holds it
        assert torch.equal(deepseek.weights[f"layers.{i}.mlp.expert_bias"],
                           model.decoder.layers[i].mlp.router.expert_bias)
    assert "layers.0.mlp.fc1.weight" in deepseek.weights  # the dense first layer
    assert "layers.0.mlp.router" not in deepseek.weights


def test_megatron_moe_files_of_tp2_and_ep2_ranks(moe, tmp_path):
    """Legacy files of megatron-core's own tp=2 and ep=2 models (2 processes: its TP split of
    the shared expert, experts and QKV, its expert placement, the GroupedMLP's per-rank views)
    import with megatron-core's logits."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from tests.distributed import run_distributed
    from tests.foreign_moe_checkpoints import save_sharded
    ranks = run_distributed(save_sharded, 2, str(tmp_path), moe["ids"])
    checked = []
    for name, want in ranks[0]:
        folder = import_checkpoint("megatron", str(tmp_path / name), str(tmp_path / f"mz_{name}"))
        got = megazoo_logits(folder, moe["ids"])
        torch.testing.assert_close(got, torch.from_numpy(want), **FP32)
        checked.append((name, (got - torch.from_numpy(want)).abs().max().item()))
    assert len(checked) == 6


def test_megatron_moe_adam_state_carries_over(moe):
    """The DeepSeek-shaped run after two AdamW steps: masters and moments of the router, the
    routed and shared experts and the dense layer equal torch's; the expert bias is a weight
    without optimizer state; step 2."""
    from megazoo.training.checkpoint.reshard import read_full_state
    run = moe["runs"]["deepseek"]
    full = read_full_state(run["imported"]["megatron"])
    assert int(full.scalars["applied_steps"]) == 2 and full.meta["iteration"] == 7
    assert "layers.1.mlp.expert_bias" not in full.optim["exp_avg"]
    params = dict(run["model"].named_parameters())
    state = run["opt"].state
    pairs = [("layers.0.mlp.fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight", None),
             ("layers.1.mlp.router", "decoder.layers.1.mlp.router.weight", None),
             ("layers.2.mlp.shared_expert.fc1.weight",
              "decoder.layers.2.mlp.shared_experts.linear_fc1.weight", None),
             ("layers.2.mlp.experts.weight2",
              "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight", 3)]
    for mz, mg, expert in pairs:
        p = params[mg]
        pick = (lambda t: t[expert]) if expert is not None else (lambda t: t)
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(pick(full.optim[s][mz]), state[p][s]), (mz, s)
        assert torch.equal(pick(full.optim["master"][mz]), p.detach()), mz
    assert len(pairs) == 4


def test_megatron_uneven_pipeline_stages(moe, tmp_path):
    """A legacy tp1/pp2 file with decoder_first_pipeline_num_layers=1 (stage 1's layers numbered
    from 0) imports with megatron-core's logits; the stage offsets are megatron-core's own."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megazoo.training.checkpoint.foreign import megatron_moe
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    run = moe["runs"]["deepseek"]
    save_uneven(str(tmp_path / "mg"), run["model"], run["args"], first=1)
    folder = import_checkpoint("megatron", str(tmp_path / "mg"), str(tmp_path / "mz"), tp=2)
    torch.testing.assert_close(megazoo_logits(folder, moe["ids"]), run["logits"], **FP32)
    checked = 0
    for layers, pp, first, last in ((3, 2, 1, None), (7, 3, None, 1), (8, 4, 1, 1), (7, 3, 3, 2)):
        args = copy.copy(run["args"])
        args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = first, last
        ours = megatron_moe.stage_offsets(args, layers, pp, 1, "test")
        cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4,
                                pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                num_layers_in_first_pipeline_stage=first,
                                num_layers_in_last_pipeline_stage=last)
        assert [ours[(p, 0)] for p in range(pp)] == [
            get_transformer_layer_offset(cfg, pp_rank=p) for p in range(pp)], (layers, pp)
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("change, match", [
    (dict(moe_router_group_topk=2, moe_router_num_groups=2, moe_router_topk=2),
     "moe_router_group_topk=2: Megatron scores a group by its best"),
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "moe_router_num_groups=2: group-limited routing under softmax"),
    (dict(moe_layer_freq=[1, 1, 0]), r"moe_layer_freq=\[1, 1, 0\]: megazoo models the first k"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(decoder_first_pipeline_num_layers=1, virtual_pipeline_model_parallel_size=2,
          pipeline_model_parallel_size=2), "uneven stages with virtual pipeline"),
    (dict(moe_expert_capacity_factor=1.0), "moe_token_drop_policy='probs': megazoo drops the "
     "tokens over capacity by position"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps=0.01: jitter on the router's input"),
])
def test_megatron_moe_unmapped_settings_are_refused(moe, tmp_path, change, match):
    from megazoo.training.checkpoint.foreign import megatron_legacy
    from megazoo.training.checkpoint.format import CheckpointError
    from tests.foreign_checkpoints import save_legacy
    run = moe["runs"]["deepseek"]
    args = copy.copy(run["args"])
    for k, v in change.items():
        setattr(args, k, v)
    save_legacy(str(tmp_path), run["model"], run["opt"], args)
    with pytest.raises(CheckpointError, match=match):
        megatron_legacy.read(str(tmp_path))


def _load_into(model, state: dict):
    """Megatron-core's model with every weight zeroed, then `state` loaded (strict but for the
    FP8 `_extra_state` entries the legacy export leaves out)."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)


def test_megatron_moe_export_loads_in_megatron_core(moe):
    """megazoo -> torch_dist that megatron-core's dist_checkpointing.load reads into each shape's
    model (the GroupedMLP one included) with equal logits; megazoo -> legacy (tp=1) that its
    load_state_dict takes with equal logits; the DeepSeek shape's legacy export at tp=2 with its
    optimizer reads back bit for bit."""
    import argparse
    import os
    from megatron.core import dist_checkpointing
    from megazoo.training.checkpoint.foreign import megatron_legacy, safe_load
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    from tests.foreign_checkpoints import cpu_stubs, megatron_logits, megatron_world
    from tests.foreign_moe_checkpoints import moe_stubs
    checked = []
    for shape, run in moe["runs"].items():
        model = run["model"]
        kept = {n: t.detach().clone() for n, t in model.state_dict().items()
                if isinstance(t, torch.Tensor)}
        folder = run["imported"]["megatron"]
        out = export_checkpoint("megatron-dist", folder, str(moe["tmp"].mktemp(f"d_{shape}")))
        legacy = str(moe["tmp"].mktemp(f"l_{shape}"))
        export_checkpoint("megatron", folder, legacy, tp=1, pp=1)
        try:
            with megatron_world(), cpu_stubs(), moe_stubs(), \
                    torch.serialization.safe_globals([argparse.Namespace]):
                for p in model.parameters():
                    p.detach().zero_()
                loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
                # (loaded in place into the model's own tensors: cloned before they are zeroed)
                _load_into(model, {k: v.clone() for k, v in loaded.items()
                                   if k in model.state_dict() and isinstance(v, torch.Tensor)})
                got = megatron_logits(model, moe["ids"])[..., :run["logits"].shape[-1]]
                assert torch.equal(got, run["logits"]), shape
                checked.append((shape, "torch_dist"))
                if not SHAPES[shape].get("moe_grouped_gemm"):  # written as SequentialMLP
                    sd = safe_load.load(os.path.join(legacy, "iter_0000007", "mp_rank_00",
                                                     "model_optim_rng.pt"))
                    _load_into(model, sd["model"])
                    got = megatron_logits(model, moe["ids"])[..., :run["logits"].shape[-1]]
                    assert torch.equal(got, run["logits"]), shape
                    checked.append((shape, "legacy"))
        finally:
            with torch.no_grad():
                model.load_state_dict(kept, strict=False)
    assert len(checked) == 5
    # the trained DeepSeek shape: legacy at tp=2 with its optimizer, read back bit for bit
    folder = moe["runs"]["deepseek"]["imported"]["megatron"]
    out = str(moe["tmp"].mktemp("l_deepseek_tp2"))
    export_checkpoint("megatron", folder, out, tp=2, pp=1)
    a = read_full_state(folder)
    _, _, b, _ = megatron_legacy.read(out)
    assert set(a.weights) == set(b.weights) and set(a.optim["exp_avg"]) == set(b.optim["exp_avg"])
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
        for s in ("master", "exp_avg", "exp_avg_sq"):
            if k in a.optim[s]:
                assert torch.equal(a.optim[s][k], b.optim[s][k]), (s, k)
    assert int(b.scalars["applied_steps"]) == 2


def test_lora_on_deepseek_without_mla_is_refused():
    import argparse
    from megazoo.models.config import TransformerConfig
    from megazoo.training.config.lora_flags import lora_settings
    config = TransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
        position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False,
        num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid")
    assert config.family == "deepseek_v3"
    args = argparse.Namespace(lora_rank=8, lora_alpha=None, lora_dropout=None,
                              lora_target_modules=None, lora_init=None)
    with pytest.raises(ValueError, match="without multi-latent attention .* no LoRA target"):
        lora_settings(args, config, tp=1)


def test_megatron_moe_layer_patterns_map_both_ways():
    """moe_layer_freq as Megatron-LM records it (an int, or its evaluated per-layer list) ->
    (moe_first_dense_layers, moe_layer_freq), and back as the list Megatron-core reads."""
    from megazoo.models.config import TransformerConfig
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.foreign import megatron_moe
    cases = {2: (0, 2), 1: (0, 1), (1, 0, 1, 0): (0, 2), (0, 0, 1, 1): (2, 1),
             (0, 1, 1, 1): (1, 1), (0, 0, 1, 0): (2, 2)}
    for freq, want in cases.items():
        got = megatron_moe.layer_pattern(list(freq) if isinstance(freq, tuple) else freq, 4, "a")
        assert got == want, freq
        config = TransformerConfig(
            vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4,
            ffn_hidden_size=48, position_embedding="rope", normalization="rmsnorm",
            activation="swiglu", bias=False, num_experts=4, moe_router_topk=2,
            moe_router_score_function="sigmoid", moe_norm_topk_prob=True,
            moe_first_dense_layers=want[0], moe_layer_freq=want[1])
        back = megatron_moe.args_fields(config)["moe_layer_freq"]
        assert back == (list(freq) if want[0] else want[1]) or (
            isinstance(freq, tuple) and back == want[1] and not want[0]), (freq, back)
    assert megatron_moe.layer_pattern("([0]*1+[1]*3)", 4, "a") == (1, 1)  # unevaluated text
    for bad in ([0, 1, 0, 1], [1, 1, 0], [0, 0, 0, 0], "[0]*1+[1]*5", "[0,1]*2"):
        with pytest.raises(CheckpointError, match="args.moe_layer_freq="):
            megatron_moe.layer_pattern(bad, 4, "a")
    assert len(cases) == 6


def test_megatron_moe_resume_next_loss_equals_megatron_next_loss(moe):
    """`--load --use-checkpoint-args` of the DeepSeek-shaped import continues the run: its loss
    equals megatron-core's, and after one more step on each side (torch's AdamW from the saved
    state; megazoo's optimizer from the imported moments and step) the next losses agree within
    1e-4 relative. Megatron-core's training loop, which updates the expert bias, is not in its
    wheel, so megazoo's update is off here (--moe-router-bias-update-rate 0)."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.hf import checkpoint_config
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from tests.foreign_checkpoints import PADDED, SEQ, cpu_stubs, megatron_world
    from tests.foreign_moe_checkpoints import moe_stubs
    run, ids = moe["runs"]["deepseek"], moe["ids"]
    save = str(moe["tmp"].mktemp("mz_resume"))
    folder = import_checkpoint("megatron", run["root"], save, tp=2, ep=2, vocab_size=PADDED)
    model = run["model"].train()
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                              "params": list(g["params"])} for g in run["opt"].param_groups])
    opt.load_state_dict(run["opt"].state_dict())  # copies: the saved state stays as it was
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pos = torch.arange(SEQ).expand(2, SEQ)
    try:
        with megatron_world(), cpu_stubs(), moe_stubs():
            loss = model(ids, pos, attention_mask=mask, labels=ids).float().mean()
            first = loss.item()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                want = model(ids, pos, attention_mask=mask, labels=ids).float().mean().item()
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(kept[n])
        model.eval()
    flags = ["--use-checkpoint-args", "--load", save, "--seq-length", str(SEQ), "--mock-data",
             "--vocab-size", str(PADDED), "--micro-batch-size", "2", "--global-batch-size", "2",
             "--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0.01",
             "--clip-grad", "0", "--adam-eps", "1e-8", "--train-iters", "10",
             "--moe-router-bias-update-rate", "0"]
    _, loaded = checkpoint_config(folder)
    run_config = to_run_config(build_parser().parse_args(flags), world_size=1, loaded=loaded)
    state = megazoo_resumes_like_megatron(run_config, ids, first, want)
    assert state.iteration == 7


def test_megatron_moe_training_settings_map():
    """Settings that change training, not the forward: balancing 'none' drops the aux loss,
    seq_aux_loss and a bias update rate of 0 are kept."""
    from megazoo.training.checkpoint.foreign import megatron_moe
    from tests.foreign_checkpoints import megatron_args
    args = megatron_args()
    args.num_experts, args.moe_router_topk, args.moe_aux_loss_coeff = 4, 2, 0.01
    args.moe_router_load_balancing_type = "none"
    assert megatron_moe.config_fields(args, "a")["moe_aux_loss_coeff"] == 0.0
    args.moe_router_load_balancing_type, args.moe_router_bias_update_rate = ["seq_aux_loss"], 0.0
    fields = megatron_moe.config_fields(args, "a")
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"],
            fields["moe_router_bias_update_rate"]) == ("seq_aux_loss", 0.01, 0.0)
