"""Megatron-core torch_dist checkpoints, distributed-optimizer saves and MoE, in and out.

The torch_dist checkpoint is written by Megatron-core's own `dist_checkpointing.save`, and
the exported one is loaded by its `dist_checkpointing.load` (CUDA calls stubbed for the CPU).
A `--use-distributed-optimizer` save's `distrib_optim.pt` is laid out by Megatron-core's own
grad buffers and written by its own DistributedOptimizer methods (on a stand-in: its
constructor refuses CPU tensors); MoE is checked in both legacy and torch_dist. The source
models and files: tests/foreign_checkpoints.py.
"""
import argparse
import os

import pytest
import torch

from tests.foreign_checkpoints import (FP32, PADDED, VOCAB, cpu_stubs, megatron_args,
                                       megatron_logits, megatron_run, megatron_world,
                                       megazoo_logits, save_dist, save_legacy)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """The source checkpoints, and the legacy one imported at tp=2, pp=2 (the megazoo checkpoint
    the torch_dist export starts from)."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    run = megatron_run(tmp_path_factory)
    run["imported"] = import_checkpoint("megatron", run["root"], str(run["tmp"].mktemp("mz")),
                                        tp=2, pp=2)
    return run


def _save_distrib_optim(root, model, opt, bucket):
    """A legacy checkpoint saved with --use-distributed-optimizer --overlap-grad-reduce
    --ddp-bucket-size `bucket`: the grad buffers are Megatron-core's own (its DDP wrapper, whose
    buckets and 64-element alignment decide the flat layout) and `distrib_optim.pt` and the
    model file's optimizer entry are written by megatron-core's own DistributedOptimizer
    methods (get_parameter_state_dp_zero, state_dict). Its constructor refuses CPU tensors,
    so they run on a stand-in holding what they read: the buffers, their param ranges and
    torch AdamW's masters and moments (Megatron's optimizer without Apex/TE is torch's)."""
    import copy
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    groups = {id(v): v for m in model.modules() for v in vars(m).values()
              if isinstance(v, dist.ProcessGroup)}  # shared, not copied
    for m in model.modules():
        for v in vars(m).values():
            groups.update({id(g): g for g in vars(v).values() if isinstance(g, dist.ProcessGroup)}
                          if hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module) else {})
    wrapped = copy.deepcopy(model, groups)  # DDP rewires its parameters: keep the fixture's
    moments = {id(c): opt.state[p] for p, c in zip(model.parameters(), wrapped.parameters())}
    with megatron_world(), cpu_stubs():
        ddp = DistributedDataParallel(wrapped.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket), wrapped)
        assert sum(len(b.buckets) for b in ddp.buffers) > 1  # the layout crosses buckets

        class Shim:
            buffers = ddp.buffers
            gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in ddp.buffers]
            data_parallel_group_gloo = dist.group.WORLD
            optimizer, grad_scaler = opt, None

            def _get_main_param_and_optimizer_states(self, param):
                s = moments[id(param)]
                return {"param": param.detach().float().view(-1), "exp_avg": s["exp_avg"].view(-1),
                        "exp_avg_sq": s["exp_avg_sq"].view(-1)}
        state = DistributedOptimizer.get_parameter_state_dp_zero(Shim())
        optimizer = DistributedOptimizer.state_dict(Shim())
    args = megatron_args()
    args.use_distributed_optimizer, args.overlap_grad_reduce, args.ddp_bucket_size = True, True, bucket
    path = save_legacy(root, model, opt, args, optimizer_state=optimizer)
    torch.save(state, os.path.join(os.path.dirname(path), "distrib_optim.pt"))


def test_megatron_distributed_optimizer_state_is_read(megatron, tmp_path):
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.foreign import megatron_legacy, names
    root = str(tmp_path / "mg")
    _save_distrib_optim(root, megatron["model"], megatron["opt"], bucket=3000)
    _, _, full, it = megatron_legacy.read(root)
    assert it == 7 and int(full.scalars["applied_steps"]) == 2
    state, checked = megatron["opt"].state, 0
    for key, p in megatron["model"].named_parameters():
        canon, split, expert = names.to_megazoo(key, 0)
        canon = "head_weight" if key == "output_layer.weight" else canon
        rows = slice(0, VOCAB) if split == "vocab" else slice(None)
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optim[s][canon], state[p][s][rows]), (key, s)
        assert torch.equal(full.optim["master"][canon], p.detach()[rows])
        checked += 1
    assert checked == len(list(megatron["model"].parameters())) > 10
    # imported at tp=2 for `--load`: the same state, iteration and step
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    imported = read_full_state(import_checkpoint("megatron", root, str(tmp_path / "mz"), tp=2))
    assert imported.meta["iteration"] == 7 and int(imported.scalars["applied_steps"]) == 2
    assert all(torch.equal(imported.optim[s][k], full.optim[s][k])
               for s in ("master", "exp_avg", "exp_avg_sq") for k in full.optim[s])
    # a flat buffer that does not match the model's parameters is refused, naming both counts
    optim_path = os.path.join(root, "iter_0000007", "mp_rank_00", "distrib_optim.pt")
    saved = torch.load(optim_path, weights_only=True)
    flat = next(iter(saved[0].values()))
    flat.update({k: flat[k][:-64] for k in ("param", "exp_avg", "exp_avg_sq")},
                numel_unpadded=flat["numel_unpadded"] - 64)
    torch.save(saved, optim_path)
    with pytest.raises(ckpt.CheckpointError, match="values, the model's parameters"):
        megatron_legacy.read(root)


def test_megatron_dist_read_and_written_for_megatron_core(megatron):
    """torch_dist from Megatron-core -> megazoo tp=2 (logits); megazoo -> torch_dist that
    Megatron-core loads into a zeroed model (same logits); torch_dist round trip bit for bit."""
    from megatron.core import dist_checkpointing
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    if "imported" not in megatron:
        pytest.fail("needs the import test's checkpoint")
    folder = import_checkpoint("megatron-dist", megatron["dist_root"],
                               str(megatron["tmp"].mktemp("mz_dist")), tp=2, pp=1)
    torch.testing.assert_close(megazoo_logits(folder, megatron["ids"]),
                               megatron["logits"][..., :VOCAB], **FP32)
    out = export_checkpoint("megatron-dist", megatron["imported"],
                            str(megatron["tmp"].mktemp("dist_out")))
    model = megatron["model"]
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with megatron_world(), cpu_stubs(), torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
        model.load_state_dict({k: v for k, v in loaded.items() if k in model.state_dict()})
        logits = megatron_logits(model, megatron["ids"])
    with torch.no_grad():  # the later tests use the source model as it was
        for n, p in model.named_parameters():
            p.copy_(kept[n])
    assert torch.equal(logits[..., :VOCAB], megatron["logits"][..., :VOCAB])
    back = import_checkpoint("megatron-dist", os.path.dirname(out),
                             str(megatron["tmp"].mktemp("mz_dist_back")))
    a, b = read_full_state(megatron["imported"]), read_full_state(back)
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
        for s in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.optim[s][k], b.optim[s][k]), (s, k)
    assert int(b.scalars["applied_steps"]) == 2 and b.meta["iteration"] == 7


def test_megatron_moe_imports_at_expert_parallel_and_round_trips(megatron, tmp_path):
    """Megatron-core's MoE GPTModel (SequentialMLP `local_experts.{e}`, top-2 of 4 experts):
    imported at tp=2, ep=2 its logits equal Megatron-core's; exported at tp=2, pp=2 and read
    back, bit for bit. The same in torch_dist: saved by Megatron-core, imported at tp=2, ep=2
    (logits), exported and loaded by Megatron-core's dist_checkpointing.load (equal logits),
    read back bit for bit."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    gemm = getattr(moe_utils, "te_general_gemm", None)
    moe_utils.te_general_gemm = None  # Megatron-core's router without Transformer Engine
    try:
        with megatron_world(), cpu_stubs():
            torch.manual_seed(0)
            cfg = TransformerConfig(
                num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, use_cpu_initialization=True, normalization="RMSNorm",
                gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                persist_layer_norm=False, gradient_accumulation_fusion=False, num_moe_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=24, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, moe_permute_fusion=False)
            model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False,
                                                           normalization="RMSNorm"),
                             vocab_size=PADDED, max_sequence_length=32,
                             position_embedding_type="rope",
                             share_embeddings_and_output_weights=False).eval()
            g = torch.Generator().manual_seed(2)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            logits = megatron_logits(model, megatron["ids"])
    finally:
        moe_utils.te_general_gemm = gemm
    args = megatron_args()
    args.num_layers, args.num_experts, args.moe_router_topk = 2, 4, 2
    args.moe_ffn_hidden_size = 24
    path = os.path.join(tmp_path, "mg", "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3,
                "model": model.state_dict()}, path)
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("3")
    folder = import_checkpoint("megatron", str(tmp_path / "mg"), str(tmp_path / "mz"), tp=2, ep=2)
    torch.testing.assert_close(megazoo_logits(folder, megatron["ids"]), logits[..., :VOCAB],
                               **FP32)
    export_checkpoint("megatron", folder, str(tmp_path / "out"), tp=2, pp=2)
    from megazoo.training.checkpoint.foreign import safe_load
    rank = safe_load.load(os.path.join(tmp_path, "out", "iter_0000003", "mp_rank_01_001",
                                       "model_optim_rng.pt"))
    fc1 = model.decoder.layers[1].mlp.experts.local_experts[3].linear_fc1.weight.detach()
    gate, up = fc1.chunk(2)  # expert 3 of layer 1 on tp rank 1: [gate_1; up_1]
    assert torch.equal(rank["model"]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
                       torch.cat([gate[12:], up[12:]]))
    back = import_checkpoint("megatron", str(tmp_path / "out"), str(tmp_path / "back"))
    a, b = read_full_state(folder).weights, read_full_state(back).weights
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # torch_dist: experts as one [layers, experts, ...] tensor, saved by Megatron-core
    with megatron_world(), cpu_stubs():
        save_dist(str(tmp_path / "dist"), model, args)
    dist = import_checkpoint("megatron-dist", str(tmp_path / "dist"), str(tmp_path / "mz_dist"),
                             tp=2, ep=2)
    torch.testing.assert_close(megazoo_logits(dist, megatron["ids"]), logits[..., :VOCAB], **FP32)
    out = export_checkpoint("megatron-dist", folder, str(tmp_path / "dist_out"))
    from megatron.core import dist_checkpointing
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    moe_utils.te_general_gemm = None
    try:
        with megatron_world(), cpu_stubs(), torch.serialization.safe_globals([argparse.Namespace]):
            loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
            model.load_state_dict({k: v for k, v in loaded.items() if k in model.state_dict()})
            # the padding rows are zeros in megazoo's export
            assert torch.equal(megatron_logits(model, megatron["ids"])[..., :VOCAB],
                               logits[..., :VOCAB])
    finally:
        moe_utils.te_general_gemm = gemm
    back = read_full_state(import_checkpoint("megatron-dist", str(tmp_path / "dist_out"),
                                             str(tmp_path / "dist_back"))).weights
    assert set(a) == set(back) and all(torch.equal(a[k], back[k]) for k in a)
