"""Megatron-core models and checkpoints the foreign-checkpoint tests start from (not a test module).

The source model is Megatron-core's own GPTModel (Llama-like: GQA, SwiGLU, RMSNorm, RoPE,
untied head), built and run on the CPU, with Adam moments from two real torch AdamW steps over
Megatron's parameter groups. Megatron-core's wheel does not ship Megatron-LM's training loop,
so the legacy file around its state dict (`iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` holding
args, iteration, model, optimizer, scheduler, RNG state) is written here by hand from the
format of Megatron-LM's training/checkpointing.py, with Megatron-core's real enums in `args`.
The torch_dist checkpoint is written by Megatron-core's own `dist_checkpointing.save` (CUDA
calls stubbed for the CPU). Used by tests/training/test_checkpoint_megatron.py,
test_checkpoint_megatron_dist.py and test_checkpoint_deepspeed.py.
"""
import argparse
import contextlib
import os
import random

import numpy as np
import torch

FP32 = dict(rtol=1e-5, atol=1e-5)  # tests/tolerances.py: fp32 logits

VOCAB, PADDED, LAYERS, SEQ = 60, 64, 4, 8


def megatron_model():
    """Megatron-core's GPTModel, its logits on fixed ids, and two AdamW steps' optimizer."""
    import warnings
    warnings.filterwarnings("ignore", module="megatron")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    with megatron_world(), cpu_stubs():
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
        return model, megatron_logits(model, ids), ids, opt


def megatron_args():
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


def save_legacy(root, model, opt, args, iteration=7, optimizer_state=None):
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


def megatron_run(tmp_path_factory):
    """Megatron-core's model after two AdamW steps, its logits on fixed ids, and its legacy and
    torch_dist checkpoints (the dict a test module's `megatron` fixture returns)."""
    import megatron.core  # noqa: F401 - installed by the dev extra (pip install -e ".[dev]")
    model, logits, ids, opt = megatron_model()
    root = str(tmp_path_factory.mktemp("megatron"))
    save_legacy(root, model, opt, megatron_args())
    dist_root = str(tmp_path_factory.mktemp("megatron_dist"))
    with megatron_world(), cpu_stubs():
        save_dist(dist_root, model, megatron_args())
    return dict(root=root, model=model, logits=logits, ids=ids, opt=opt, dist_root=dist_root,
                tmp=tmp_path_factory)


@contextlib.contextmanager
def megatron_world():
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
def cpu_stubs():
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


def save_dist(root, model, args, iteration=7):
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


def megazoo_logits(folder, ids):
    """Logits of a megazoo checkpoint loaded in this process at tp=pp=1 (any saved layout; a
    LoRA run's with its adapters)."""
    from megazoo.training.checkpoint.hf import checkpoint_config
    from megazoo.training.checkpoint.layout_writer import build_rank_chunks
    from megazoo.training.checkpoint.reshard import load_weights
    meta, config = checkpoint_config(folder)
    topo, chunks = build_rank_chunks(config, tp=1, pp=1, vpp=1, dp=1, rank=0, lora=meta.get("lora"))
    load_weights(folder, chunks, topo)
    with torch.no_grad():
        return chunks[0].eval()(ids)[..., :config.vocab_size]  # vocabulary padding cut


def megatron_logits(model, ids):
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    with torch.no_grad():
        return model(ids, torch.arange(SEQ).expand(ids.shape[0], SEQ), attention_mask=mask)


def pickle_globals(path) -> set:
    """The classes a torch.save file's pickle names (module.qualname), read without loading it."""
    import pickletools
    import zipfile
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def megazoo_resumes_like_megatron(run_config, ids, first: float, want: float):
    """megazoo's run loaded as `run_config` says (its --load), one process: the loss on `ids`
    equals Megatron's `first` (1e-5 relative) and, after one step on the same batch, its `want`
    (1e-4 relative). Returns the loaded training state."""
    from megazoo.models.registry import build_model as model_provider
    from megazoo.parallel.random import model_parallel_seed
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.parallel.zero.optimizer import build_optimizer
    from megazoo.training.checkpoint.resume import load
    from megazoo.training.run.loop import build_chunks
    topo = ParallelTopology.single()
    seed = model_parallel_seed(run_config.seed, topo)
    chunks = build_chunks(model_provider, run_config, topo, seed)
    zero = build_optimizer(chunks, topo, run_config.optimizer)
    state = load(run_config, topo, chunks, zero, None)
    zero.zero_grad()
    loss = chunks[0](ids, labels=ids).mean()
    assert abs(loss.item() - first) <= 1e-5 * abs(first), (loss.item(), first)
    zero.backward(loss)
    assert not zero.step(loss).skipped
    with torch.no_grad():
        got = chunks[0](ids, labels=ids).mean().item()
    assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    return state
