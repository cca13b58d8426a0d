"""DeepSeek-V3's MoE model under parallel layouts and in checkpoints.

* A model of MLA + DeepSeek MoE layers under (tp2 + SP, ep2, dp2) and (pp2, ep2, dp2) with ZeRO-1: losses, expert
  biases after each update and parameters after 2 AdamW steps equal the unsharded model's (the
  load summed over all ranks).
* The expert biases are in the checkpoint files at every ZeRO stage and survive a change of
  layout bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.models.moe import MoELayer, moe_layers, update_expert_biases
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from tests.distributed import run_distributed
from tests.helpers import HYPER, accumulated_backward
from tests.hf_models import MLA_LATENT, deepseek_config
from tests.tolerances import assert_trained_close

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, STEPS = 8, 8, 2


def _parallel_config() -> TransformerConfig:
    return deepseek_config(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                           moe_router_bias_update_rate=0.05, **MLA_LATENT)  # MLA attention


def _batch(step: int):
    tokens = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(50 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _biases(model) -> dict[int, torch.Tensor]:
    """Global layer number -> a copy of that MoE layer's expert bias."""
    return {i: layer.mlp.expert_bias.clone() for i, layer in
            ((int(k), v) for k, v in model.layers.items()) if isinstance(layer.mlp, MoELayer)}


def _reference(cfg, dp: int):
    """The unsharded model on the whole batch, one microbatch per DP share (each its own aux
    loss), torch AdamW: (losses, biases per step per layer, trained parameters)."""
    from megazoo.models.moe import set_aux_loss_scale
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                              "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    set_aux_loss_scale([model], 1.0 / dp)
    losses, biases = [], []
    for step in range(STEPS):
        total = accumulated_backward(model, *_batch(step), dp)
        torch.nn.utils.clip_grad_norm_([p for _, p in named], HYPER["clip_grad"])
        opt.step()
        opt.zero_grad()
        update_expert_biases([model], cfg.num_layers, torch.device("cpu"))
        losses.append(total)
        biases.append(_biases(model))
    return losses, biases, {n: p.detach().clone() for n, p in named}


def _bias_world(rank, layouts):
    from megazoo.training.run.step import activation_shape, forward_backward
    cfg = _parallel_config()
    initial = {n: p.detach().clone() for n, p in
               TransformerLanguageModel(cfg, ParallelTopology.single()).named_parameters()}
    out = []
    for kw in layouts:
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        ref_losses, ref_biases, ref_params = _reference(cfg, topo.dp)
        spec, = partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]
        model = TransformerLanguageModel(cfg, topo, **spec.kwargs())
        opt = build_optimizer([model], topo, OptimizerConfig(**HYPER, zero_stage=1))
        shape = activation_shape(topo, SEQ, BATCH // topo.dp, cfg.hidden_size)
        moved = 0
        for step in range(STEPS):
            ids, labels = (t.chunk(topo.dp)[topo.dp_rank] for t in _batch(step))
            loss = forward_backward([model], [{"tokens": ids, "labels": labels}], topo, opt,
                                    schedule="1f1b", shape=shape)
            assert not opt.step().skipped
            opt.zero_grad()
            update_expert_biases([model], cfg.num_layers, topo.device)
            torch.testing.assert_close(loss, ref_losses[step], **TOL, msg=f"{kw} loss {step}")
            for i, bias in _biases(model).items():
                want = ref_biases[step][i]
                torch.testing.assert_close(bias, want, rtol=0, atol=1e-7, msg=f"{kw} bias {i} step {step}")
                moved += int((want != 0).sum())
        dp_full = opt.full_parameters()
        got = {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
               for n, p in model.named_parameters() if p.requires_grad}
        assert_trained_close(got, ref_params, initial, str(kw), HYPER["lr"])
        out.append(moved)
    return out


def test_expert_bias_updates_under_tensor_sequence_pipeline_expert_and_data_parallel_equal_unsharded():
    layouts = [dict(tp=2, ep=2, sequence_parallel=True), dict(pp=2, ep=2)]  # dp 2
    moved = run_distributed(_bias_world, 4, layouts, timeout=600)
    assert all(m > 0 for m in moved[0])  # the biases moved, so the comparison saw updates


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_files_carry_the_expert_bias_at_every_zero_stage(stage):
    from megazoo.training.checkpoint.save import rank_tensors
    cfg = deepseek_config()
    topo = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer([model], topo, OptimizerConfig(zero_stage=stage))

    class _NoRng:
        def get_states(self):
            return {}
    tensors = rank_tensors([model], opt, _NoRng(), stage)
    biases = sorted(k for k in tensors if k.endswith("expert_bias"))
    assert biases == ["model.0.layers.0.mlp.expert_bias", "model.0.layers.1.mlp.expert_bias"]
    assert ("model.0.layers.0.mlp.router" in tensors) == (stage < 3)


def test_expert_biases_survive_a_change_of_layout_bit_for_bit(tmp_path, caplog):
    """The frozen expert biases travel through the layout-independent table: written at
    (pp2, dp2, ZeRO-3), read back whole and by a rank of another layout whose ZeRO shards need
    only the last element of every tensor, then rewritten at tp2 and loaded into a live unsharded model."""
    import math
    from megazoo.training.checkpoint import layout_writer, reshard, slices
    from megazoo.training.checkpoint.param_table import SliceEntry, param_table
    cfg = _parallel_config()
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.expert_bias.copy_(torch.randn(cfg.num_experts, generator=g) / 3)
    biases = _biases(model)
    weights = {model.canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    trained = {k: v for k, v in weights.items() if not k.endswith("expert_bias")}
    optim = {"master": trained, "exp_avg": {k: v * 0.5 for k, v in trained.items()}}
    full = reshard.FullState(dict(consumed_samples=0, skipped_steps=0), weights, optim)
    src = layout_writer.write_layout(full, str(tmp_path / "a"), config=cfg, tp=1, pp=2, dp=2,
                               zero_stage=3)
    back = reshard.read_full_state(src)
    for i, bias in biases.items():
        assert torch.equal(back.weights[f"layers.{i}.mlp.expert_bias"], bias)
        assert f"layers.{i}.mlp.expert_bias" not in back.master  # weights only, no state

    topo, chunks = layout_writer.build_rank_chunks(cfg, tp=1, pp=1, vpp=1, dp=2, rank=1)
    rows = param_table(chunks, frozen=True)
    ranges = [[i, math.prod(r.shape) - 1, math.prod(r.shape), 0] for i, r in enumerate(rows)
              if not r.frozen]
    part = reshard.read_full_state(src, {r.canonical for r in rows},
                                   need=slices.need_of(rows, 0, 1, ranges))
    for i, bias in biases.items():
        assert torch.equal(part.weights[f"layers.{i}.mlp.expert_bias"], bias)
    # the first data-parallel rank's file is opened for the frozen biases alone once nothing
    # else it holds is needed (here the experts, always read whole, are taken out of the record)
    record = dict(reshard.ckpt.read_meta(src)["slices"])
    record["params"] = {k: v for k, v in record["params"].items()
                        if not SliceEntry.from_json(v).expert}
    need = slices.need_of(rows, 0, 1, ranges)
    assert [slices.file_wanted(record, 0, 0, 0, 1, need, optimizer_shards=True, holds_frozen=h)
            for h in ((True, True), (False, False))] == [True, False]

    dst = layout_writer.write_layout(back, str(tmp_path / "b"), config=cfg, tp=2, pp=1, weights_only=True)
    fresh = TransformerLanguageModel(cfg, ParallelTopology.single())
    assert not any(torch.equal(b, biases[i]) for i, b in _biases(fresh).items())
    reshard.load_weights(dst, [fresh], ParallelTopology.single())
    loaded = _biases(fresh)
    assert loaded.keys() == biases.keys() and len(loaded) == 2
    assert all(torch.equal(loaded[i], biases[i]) and loaded[i].dtype == torch.float32 for i in loaded)

    # a checkpoint from before the biases were recorded: they keep their values, one log line
    old = reshard.FullState(back.meta, {k: v for k, v in back.weights.items()
                                        if not k.endswith("expert_bias")})
    other = TransformerLanguageModel(cfg, ParallelTopology.single())
    before = _biases(other)
    with caplog.at_level("WARNING", logger="megazoo.training.checkpoint.reshard"):
        reshard.copy_weights(old, [other], ParallelTopology.single(), "old", frozen_only=False)
    assert all(torch.equal(b, before[i]) for i, b in _biases(other).items())
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "old records no frozen parameters (written before they were saved layout-independently)"]
