"""Megatron-LM legacy checkpoints in and out (training/checkpoint/foreign/).

The source model is Megatron-core's own GPTModel (Llama-like: GQA, SwiGLU, RMSNorm, RoPE,
untied head), built and run on the CPU, with Adam moments from two real torch AdamW steps over
Megatron's parameter groups. Megatron-core's wheel does not ship Megatron-LM's training loop,
so the legacy file around its state dict (`iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` holding
args, iteration, model, optimizer, scheduler, RNG state) is written here by hand from the
format of Megatron-LM's training/checkpointing.py, with Megatron-core's real enums in `args`.
The torch_dist checkpoint is written by Megatron-core's own `dist_checkpointing.save`, and
the exported one is loaded by its `dist_checkpointing.load` (CUDA calls stubbed for the CPU).
Checked: imported at another layout the logits equal Megatron-core's forward within 1e-5,
iteration, consumed samples and Adam moments carry over exactly, export -> import is bit for
bit, TP shards follow Megatron's [gate_r; up_r], unsafe or inconsistent files are refused.
A `--use-distributed-optimizer` save's `distrib_optim.pt` is laid out by Megatron-core's own
grad buffers and written by its own DistributedOptimizer methods (on a stand-in: its
constructor refuses CPU tensors); MoE is checked in both legacy and torch_dist; DeepSpeed
universal checkpoints are exported and read back bit for bit.
"""
import argparse
import contextlib
import os
import random

import numpy as np
import pytest
import torch

FP32 = dict(rtol=1e-5, atol=1e-5)  # tests/tolerances.py: fp32 logits

VOCAB, PADDED, LAYERS, SEQ = 60, 64, 4, 8


def _megatron_model():
    """Megatron-core's GPTModel, its logits on fixed ids, and two AdamW steps' optimizer."""
    import warnings
    warnings.filterwarnings("ignore", module="megatron")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    with _megatron_world(), _cpu_stubs():
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=48, use_cpu_initialization=True, normalization="RMSNorm",
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False, layernorm_epsilon=1e-5)
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=PADDED,
                         max_sequence_length=32, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # norms at 1 would hide a mixed-up norm
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        pos = torch.arange(SEQ).expand(2, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
        # Megatron's parameter groups: no weight decay for biases and 1-D tensors
        decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
        no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
        opt = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0,
                                  "is_expert_parallel": False, "is_decoupled_lr": False},
                                 {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0,
                                  "is_expert_parallel": False, "is_decoupled_lr": False,
                                  "weight_decay": 0.0}], lr=1e-2, weight_decay=0.01)
        model.train()
        for _ in range(2):
            loss = model(ids, pos, attention_mask=mask, labels=ids).float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        return model, _megatron_logits(model, ids), ids, opt


def _args():
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=8,
        max_position_embeddings=32, seq_length=SEQ, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5,
        swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
        padded_vocab_size=PADDED, vocab_size=VOCAB, make_vocab_size_divisible_by=16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        consumed_train_samples=56, iteration=7, bf16=False, fp16=False,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder, use_distributed_optimizer=False)


def _save_legacy(root, model, opt, args, iteration=7, optimizer_state=None):
    """Megatron-LM's legacy file layout; `optimizer_state`: what Megatron's optimizer saved
    (default: the torch optimizer's own state dict)."""
    path = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "model": model.state_dict(),
                "optimizer": opt.state_dict() if optimizer_state is None else optimizer_state,
                "opt_param_scheduler": {"max_lr": 1e-2, "min_lr": 0.0, "num_steps": 56,
                                        "lr_warmup_steps": 0, "lr_decay_steps": 100,
                                        "lr_decay_style": "cosine"},
                "rng_state": [{"random_rng_state": random.getstate(),
                               "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(),
                               "cuda_rng_state": None, "rng_tracker_states": {}}]}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return path


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    import megatron.core  # noqa: F401 - installed by the dev extra (pip install -e ".[dev]")
    model, logits, ids, opt = _megatron_model()
    root = str(tmp_path_factory.mktemp("megatron"))
    _save_legacy(root, model, opt, _args())
    dist_root = str(tmp_path_factory.mktemp("megatron_dist"))
    with _megatron_world(), _cpu_stubs():
        _save_dist(dist_root, model, _args())
    return dict(root=root, model=model, logits=logits, ids=ids, opt=opt, dist_root=dist_root,
                tmp=tmp_path_factory)


@contextlib.contextmanager
def _megatron_world():
    import torch.distributed as dist
    from megatron.core import parallel_state
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _cpu_stubs():
    """Megatron-core's CUDA calls made harmless on the CPU (device queries, stream syncs, the
    RNG tracker's fork around eval-mode dropout, the writer's GPU memory report)."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = (torch.cuda.current_device, torch.cuda.synchronize, tracker.fork,
             filesystem_async._process_memory)
    torch.cuda.current_device, torch.cuda.synchronize = (lambda: "cpu"), (lambda *a: None)
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    filesystem_async._process_memory = lambda: 0
    try:
        yield
    finally:
        (torch.cuda.current_device, torch.cuda.synchronize, tracker.fork,
         filesystem_async._process_memory) = saved


def _save_dist(root, model, args, iteration=7):
    """A torch_dist checkpoint as Megatron-LM saves one: Megatron-core's sharded state dict and
    the run's common state, written by Megatron-core's dist_checkpointing."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, folder, sharded_strategy=TorchDistSaveShardedStrategy(
        "torch_dist", 1, thread_count=1))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _megazoo_logits(folder, ids):
    """Logits of a megazoo checkpoint loaded in this process at tp=pp=1 (any saved layout)."""
    from training.checkpoint.hf import checkpoint_config
    from training.checkpoint.layout_writer import build_rank_chunks
    from training.checkpoint.reshard import load_weights
    _, config = checkpoint_config(folder)
    topo, chunks = build_rank_chunks(config, tp=1, pp=1, vpp=1, dp=1, rank=0)
    load_weights(folder, chunks, topo)
    with torch.no_grad():
        return chunks[0].eval()(ids)[..., :config.vocab_size]  # vocabulary padding cut


def test_megatron_import_at_another_layout_continues_the_run(megatron):
    from training.checkpoint.foreign.convert import import_checkpoint
    from training.checkpoint.reshard import read_full_state
    save = str(megatron["tmp"].mktemp("mz"))
    folder = import_checkpoint("megatron", megatron["root"], save, tp=2, pp=2)
    logits = _megazoo_logits(folder, megatron["ids"])
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
    with _megatron_world(), _cpu_stubs():
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
    args = _args()
    args.use_distributed_optimizer, args.overlap_grad_reduce, args.ddp_bucket_size = True, True, bucket
    path = _save_legacy(root, model, opt, args, optimizer_state=optimizer)
    torch.save(state, os.path.join(os.path.dirname(path), "distrib_optim.pt"))


def test_megatron_distributed_optimizer_state_is_read(megatron, tmp_path):
    from training.checkpoint import format as ckpt
    from training.checkpoint.foreign import megatron_legacy, names
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
    from training.checkpoint.foreign.convert import import_checkpoint
    from training.checkpoint.reshard import read_full_state
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


def test_megatron_export_shards_like_megatron_and_round_trips(megatron):
    from training.checkpoint.foreign import safe_load
    from training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from training.checkpoint.reshard import read_full_state
    if "imported" not in megatron:
        pytest.fail("needs the import test's checkpoint")
    from training.checkpoint import format as ckpt
    out = str(megatron["tmp"].mktemp("mg_out"))
    with pytest.raises(ckpt.CheckpointError, match="only Megatron-DeepSpeed's GPT and BLOOM"):
        export_checkpoint("deepspeed", megatron["imported"], out)  # Llama: no universal names
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
    from training.checkpoint.foreign import safe_load
    from training.checkpoint.foreign.convert import import_checkpoint
    from training.checkpoint.format import CheckpointError
    bad = tmp_path / "bad.pt"
    torch.save({"args": _Payload()}, bad)
    with pytest.raises(safe_load.UnsafeCheckpointError, match="_Payload"):
        safe_load.load(str(bad))
    args = _args()
    args.num_query_groups = 4  # the saved QKV has 2 groups' rows
    root = str(tmp_path / "mg")
    _save_legacy(root, megatron["model"], megatron["opt"], args)
    with pytest.raises(CheckpointError, match=r"qkv.weight has shape \(64, 32\).*give \(96, 32\)"):
        import_checkpoint("megatron", root, str(tmp_path / "out"))


def _tool(name):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_tools_name_and_convert_the_checkpoint(megatron, tmp_path, capsys):
    assert "Megatron-LM legacy checkpoint (iteration 7): tp=1 pp=1 ep=1 vpp=1, 4 layers" in \
        _tool("inspect_checkpoint")._foreign(megatron["root"])
    assert "Megatron-core torch_dist checkpoint (iteration 7), saved at tp=1 pp=1" in \
        _tool("inspect_checkpoint")._foreign(megatron["dist_root"])
    convert = _tool("convert_checkpoint")
    save = str(tmp_path / "mz")
    assert convert.main(["import", "--format", "megatron", "--load", megatron["root"], "--save",
                         save, "--tensor-model-parallel-size", "2", "--no-optimizer"]) == 0
    from training.checkpoint.format import read_meta, resolve
    meta = read_meta(resolve(save))
    assert meta["weights_only"] and meta["layout"]["tp"] == 2 and meta["model"]["family"] == "llama"
    assert convert.main(["export", "--format", "megatron", "--load", save, "--save",
                         str(tmp_path / "mg"), "--pipeline-model-parallel-size", "3"]) == 1
    assert "4 layers do not split over pp=3" in capsys.readouterr().err


def _megatron_logits(model, ids):
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    with torch.no_grad():
        return model(ids, torch.arange(SEQ).expand(ids.shape[0], SEQ), attention_mask=mask)


def test_megatron_dist_read_and_written_for_megatron_core(megatron):
    """torch_dist from Megatron-core -> megazoo tp=2 (logits); megazoo -> torch_dist that
    Megatron-core loads into a zeroed model (same logits); torch_dist round trip bit for bit."""
    from megatron.core import dist_checkpointing
    from training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from training.checkpoint.reshard import read_full_state
    if "imported" not in megatron:
        pytest.fail("needs the import test's checkpoint")
    folder = import_checkpoint("megatron-dist", megatron["dist_root"],
                               str(megatron["tmp"].mktemp("mz_dist")), tp=2, pp=1)
    torch.testing.assert_close(_megazoo_logits(folder, megatron["ids"]),
                               megatron["logits"][..., :VOCAB], **FP32)
    out = export_checkpoint("megatron-dist", megatron["imported"],
                            str(megatron["tmp"].mktemp("dist_out")))
    model = megatron["model"]
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with _megatron_world(), _cpu_stubs(), torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
        model.load_state_dict({k: v for k, v in loaded.items() if k in model.state_dict()})
        logits = _megatron_logits(model, megatron["ids"])
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


def _bloom_layer_files(folder, hf, tp, padded, drift):
    """Megatron-DeepSpeed's pipeline layout of a Hugging Face BLOOM, as BLOOM-176B was saved:
    written by hand from the format (layer 1 the embedding, 3.. the blocks, L+4 the final norm;
    Hugging Face's BLOOM converter reads the same names and splits). DeepSpeed is not installed
    by the tests. `drift` is added to rank 0's and taken from rank 1's copy of one norm."""
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
    from training.checkpoint.foreign.convert import import_checkpoint
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
    torch.testing.assert_close(_megazoo_logits(out, bloom["ids"]), bloom["logits"], **FP32)
    line = _tool("inspect_checkpoint")._foreign(str(tmp_path / "bloom"))
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
    (DeepSpeed is not installed by the tests): fp32 masters, moments and step carry over.
    Exported back (the files of universal_checkpoint.py's loader: `param`, `cat_dim`,
    `vocab_tensor`, step.pt, latest_universal) it imports bit for bit."""
    from training.checkpoint.foreign.convert import import_checkpoint
    from training.checkpoint.reshard import read_full_state
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
    torch.testing.assert_close(_megazoo_logits(out, bloom["ids"]), bloom["logits"], **FP32)
    full = read_full_state(out)
    assert int(full.scalars["applied_steps"]) == 5 and full.meta["iteration"] == 12
    assert full.meta["consumed_samples"] == 96
    for mz, hf_name in (("layers.1.attention.qkv.weight", "transformer.h.1.self_attention.query_key_value.weight"),
                        ("embedding.norm.bias", "transformer.word_embeddings_layernorm.bias"),
                        ("layers.2.mlp.fc2.weight", "transformer.h.2.mlp.dense_4h_to_h.weight")):
        assert torch.equal(full.optim["exp_avg"][mz], moments[hf_name][0])
        assert torch.equal(full.optim["exp_avg_sq"][mz], moments[hf_name][1])
    assert "DeepSpeed universal checkpoint (global_step12)" in \
        _tool("inspect_checkpoint")._foreign(str(tmp_path / "ds"))
    # export: the universal layout DeepSpeed's loader reads, and back bit for bit
    from training.checkpoint.foreign.convert import export_checkpoint
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


def test_megatron_resume_next_loss_equals_megatron_next_loss(megatron):
    """`--load` of the import continues the run: after one more step on each side (Megatron-core
    with torch's AdamW from its saved state; megazoo's optimizer from the imported moments and
    step count), the next losses agree within 1e-4 relative. Megatron's softmax runs over the
    padded vocabulary, so the import keeps the padding rows as tokens (--vocab-size 64)."""
    from train_llama import model_provider
    from parallel.random import model_parallel_seed
    from parallel.topology import ParallelTopology
    from parallel.zero.optimizer import build_optimizer
    from training.checkpoint.resume import load
    from training.config.flags import to_run_config
    from training.config.parser import build_parser
    from training.run.loop import build_chunks
    from training.checkpoint.foreign.convert import import_checkpoint
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
    with _megatron_world(), _cpu_stubs():
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
    topo = ParallelTopology.single()
    chunks = build_chunks(model_provider, run, topo, model_parallel_seed(run.seed, topo))
    zero = build_optimizer(chunks, topo, run.optimizer)
    state = load(run, topo, chunks, zero, None)
    assert (state.iteration, state.consumed_samples) == (7, 56)
    zero.zero_grad()
    loss = chunks[0](ids, labels=ids).mean()
    assert abs(loss.item() - first) <= 1e-5 * abs(first), (loss.item(), first)
    zero.backward(loss)
    assert not zero.step(loss).skipped
    with torch.no_grad():
        got = chunks[0](ids, labels=ids).mean().item()
    assert abs(got - want) <= 1e-4 * abs(want), (got, want)


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
    from training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from training.checkpoint.reshard import read_full_state
    gemm = getattr(moe_utils, "te_general_gemm", None)
    moe_utils.te_general_gemm = None  # Megatron-core's router without Transformer Engine
    try:
        with _megatron_world(), _cpu_stubs():
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
            logits = _megatron_logits(model, megatron["ids"])
    finally:
        moe_utils.te_general_gemm = gemm
    args = _args()
    args.num_layers, args.num_experts, args.moe_router_topk = 2, 4, 2
    args.moe_ffn_hidden_size = 24
    path = os.path.join(tmp_path, "mg", "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3,
                "model": model.state_dict()}, path)
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("3")
    folder = import_checkpoint("megatron", str(tmp_path / "mg"), str(tmp_path / "mz"), tp=2, ep=2)
    torch.testing.assert_close(_megazoo_logits(folder, megatron["ids"]), logits[..., :VOCAB],
                               **FP32)
    export_checkpoint("megatron", folder, str(tmp_path / "out"), tp=2, pp=2)
    from training.checkpoint.foreign import safe_load
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
    with _megatron_world(), _cpu_stubs():
        _save_dist(str(tmp_path / "dist"), model, args)
    dist = import_checkpoint("megatron-dist", str(tmp_path / "dist"), str(tmp_path / "mz_dist"),
                             tp=2, ep=2)
    torch.testing.assert_close(_megazoo_logits(dist, megatron["ids"]), logits[..., :VOCAB], **FP32)
    out = export_checkpoint("megatron-dist", folder, str(tmp_path / "dist_out"))
    from megatron.core import dist_checkpointing
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    moe_utils.te_general_gemm = None
    try:
        with _megatron_world(), _cpu_stubs(), torch.serialization.safe_globals([argparse.Namespace]):
            loaded = dist_checkpointing.load(model.sharded_state_dict(), out)
            model.load_state_dict({k: v for k, v in loaded.items() if k in model.state_dict()})
            # the padding rows are zeros in megazoo's export
            assert torch.equal(_megatron_logits(model, megatron["ids"])[..., :VOCAB],
                               logits[..., :VOCAB])
    finally:
        moe_utils.te_general_gemm = gemm
    back = read_full_state(import_checkpoint("megatron-dist", str(tmp_path / "dist_out"),
                                             str(tmp_path / "dist_back"))).weights
    assert set(a) == set(back) and all(torch.equal(a[k], back[k]) for k in a)


def _zero_files(folder, hf, stage, world, moments, zero_stage_enum):
    """DeepSpeed ZeRO-`stage` files of a Hugging Face model over `world` data-parallel ranks,
    written by hand from DeepSpeed's format (stage_1_and_2.py / stage3.py state dicts, as
    zero_to_fp32.py reads them): two parameter groups (weight decay, none)."""
    from collections import OrderedDict
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    groups = [[(n, p) for n, p in named if p.dim() > 1], [(n, p) for n, p in named if p.dim() == 1]]
    shapes = [OrderedDict((n, p.shape) for n, p in g) for g in groups]
    torch.save({"module": hf.state_dict() if stage < 3 else {}, "param_shapes": shapes,
                "global_steps": 9, "global_samples": 72, "ds_version": "0.19.8"},
               os.path.join(folder, "mp_rank_00_model_states.pt"))

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
    from training.checkpoint.foreign.convert import import_checkpoint
    from training.checkpoint.reshard import read_full_state
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
        _tool("inspect_checkpoint")._foreign(str(tmp_path / "ds"))
    out = import_checkpoint("deepspeed", str(tmp_path / "ds"), str(tmp_path / "mz"), tp=2,
                            hf_config=str(tmp_path / "hf"))
    ids = torch.randint(0, VOCAB_BLOOM, (2, SEQ))
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(_megazoo_logits(out, ids), want, **FP32)
    full = read_full_state(out)
    assert int(full.scalars["applied_steps"]) == 9 and full.meta["consumed_samples"] == 72
    for mz, name in (("layers.1.input_norm.weight", "transformer.h.1.ln_1.weight"),
                     ("embedding.word_embeddings.weight", "transformer.wte.weight"),
                     ("layers.0.mlp.fc2.weight", "transformer.h.0.mlp.c_proj.weight")):
        t = (lambda x: x.t()) if mz.endswith("fc2.weight") else (lambda x: x)  # GPT-2's Conv1D
        assert torch.equal(full.optim["exp_avg"][mz], t(moments[0][name]))
        assert torch.equal(full.optim["exp_avg_sq"][mz], t(moments[1][name]))
