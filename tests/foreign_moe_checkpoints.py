"""Megatron-core MoE models and their checkpoints (not a test module), for
tests/training/test_checkpoint_megatron_moe.py.

Three shapes are built with megatron-core 0.16.1's own GPTModel on the CPU, local spec
(`get_gpt_decoder_block_spec(use_transformer_engine=False)`, which reads moe_layer_freq):

    qwen2_moe   shared expert with its sigmoid gate, softmax over all experts then top-2,
                QKV bias; experts as SequentialMLP (`local_experts.{e}`)
    deepseek    sigmoid routing with a (non-zero) expert bias, 2 groups of 2 experts (the best
                group kept), top-2 renormalised and scaled by 2.5, a shared expert, the first
                layer dense (moe_layer_freq [0, 1, 1]); ordinary GQA attention
    qwen3_moe   q/k norms, top-2 logits then softmax, no shared expert; experts as the legacy
                GroupedMLP (--moe-grouped-gemm without Transformer Engine)

The GroupedMLP needs the `grouped_gemm` CUDA package and asserts bf16 in its forward; here its
`gmm` is a per-expert matmul, its activation is not passed through torch.compile (megatron-core's
`jit_fuser`; inductor's CPU code returned zeros under ATEN_CPU_CAPABILITY=avx2) and its own config
copy says bf16 (the model stays fp32): the weights' layout and every view of them are
megatron-core's. Megatron-core's router calls
Transformer Engine's gemm when importable; it is set to None as in the existing MoE test.
"""
import argparse
import contextlib
import copy
import os

import torch

from tests.foreign_checkpoints import (PADDED, SEQ, VOCAB, cpu_stubs, megatron_args,
                                       megatron_logits, megatron_world, save_dist, save_legacy)

SHAPES = {
    "qwen2_moe": dict(num_layers=2, moe_shared_expert_intermediate_size=40,
                      moe_shared_expert_gate=True, moe_router_pre_softmax=True, add_qkv_bias=True),
    "deepseek": dict(num_layers=3, moe_shared_expert_intermediate_size=40,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1, 1]),
    "qwen3_moe": dict(num_layers=2, qk_layernorm=True, moe_grouped_gemm=True),
}


def _gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm: rows of `a` in groups of `batch_sizes`, group i times b[i]."""
    outs, start = [], 0
    for i, n in enumerate(batch_sizes.tolist()):
        w = b[i].t() if trans_b else b[i]
        outs.append(a[start:start + n] @ w)
        start += n
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])


@contextlib.contextmanager
def moe_stubs():
    """Megatron-core's MoE on the CPU: no TE gemm in the router, grouped_gemm's gmm as matmuls."""
    from megatron.core.transformer.moe import experts, grouped_gemm_util, moe_utils

    class Ops:
        gmm = staticmethod(_gmm)
    saved = (getattr(moe_utils, "te_general_gemm", None), grouped_gemm_util.grouped_gemm,
             grouped_gemm_util.ops, experts.jit_fuser)
    moe_utils.te_general_gemm = None
    grouped_gemm_util.grouped_gemm, grouped_gemm_util.ops = object(), Ops
    experts.jit_fuser = lambda fn: fn  # the GroupedMLP's activation uncompiled (same function)
    try:
        yield
    finally:
        (moe_utils.te_general_gemm, grouped_gemm_util.grouped_gemm, grouped_gemm_util.ops,
         experts.jit_fuser) = saved


def build(shape: str, seed: int = 0):
    """Megatron-core's GPTModel of one MoE shape, its weights perturbed (norms away from 1, the
    expert bias away from 0), in eval mode."""
    import warnings
    warnings.filterwarnings("ignore", module="megatron")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = dict(SHAPES[shape])
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_token_dispatcher_type="allgather", moe_permute_fusion=False, **fields)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=PADDED, max_sequence_length=32,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    for m in model.modules():
        if type(m).__name__ == "GroupedMLP":  # its forward asserts bf16; the weights stay fp32
            m.config = copy.copy(m.config)
            m.config.bf16 = True
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()


def args_of(shape: str, model) -> argparse.Namespace:
    """Megatron-LM's recorded args for one shape (its MoE flags as argparse names them)."""
    cfg = model.config
    args = megatron_args()
    args.num_layers = cfg.num_layers
    args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = 4, 2, 24
    for name in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                 "moe_router_pre_softmax", "moe_router_score_function",
                 "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor", "moe_layer_freq", "moe_grouped_gemm",
                 "qk_layernorm", "add_qkv_bias"):
        setattr(args, name, getattr(cfg, name))
    args.transformer_impl = "local"
    args.moe_router_load_balancing_type = "aux_loss"
    return args


def adamw_steps(model, ids, steps: int = 2):
    """`steps` AdamW steps over Megatron's parameter groups ((weight-decay multiplier, expert)
    in first-seen order, each in module order); the model back in eval mode."""
    groups, order = {}, []
    for name, p in model.named_parameters():
        key = (0.0 if name.endswith(".bias") or p.dim() == 1 else 1.0, ".mlp.experts." in name)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(p)
    opt = torch.optim.AdamW([{"params": groups[k], "wd_mult": k[0], "lr_mult": 1.0,
                              "is_expert_parallel": k[1], "is_decoupled_lr": False,
                              "weight_decay": 0.01 * k[0]} for k in order], lr=1e-2)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)
    pos = torch.arange(SEQ).expand(ids.shape[0], SEQ)
    model.train()
    for _ in range(steps):
        loss = model(ids, pos, attention_mask=mask, labels=ids).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), opt


def save_uneven(root, model, args, first: int, iteration: int = 5):
    """A legacy tp1/pp2 checkpoint with `decoder_first_pipeline_num_layers` = `first`: each
    stage file numbers its layers from 0 (Megatron-LM's layout), weights only."""
    sd = model.state_dict()
    args = copy.copy(args)
    args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers = 2, first
    for stage in range(2):
        part = {}
        for k, v in sd.items():
            if k.startswith("decoder.layers."):
                layer, rest = k[len("decoder.layers."):].split(".", 1)
                local = int(layer) - (0 if stage == 0 else first)
                if (int(layer) < first) == (stage == 0):
                    part[f"decoder.layers.{local}.{rest}"] = v
            elif k.startswith("embedding.") == (stage == 0):
                part[k] = v
        path = os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_00_{stage:03d}",
                            "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path))
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": part}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def moe_runs(tmp_path_factory):
    """Each shape's model, its logits on fixed ids, args, legacy and torch_dist checkpoints (the
    DeepSeek shape after two AdamW steps, its optimizer in the legacy file); one megatron world."""
    import megatron.core  # noqa: F401 - installed by the dev extra
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    runs = {}
    with megatron_world(), cpu_stubs(), moe_stubs():
        for i, shape in enumerate(SHAPES):
            model = build(shape, seed=10 * i)
            args = args_of(shape, model)
            opt = None
            if shape == "deepseek":
                model, opt = adamw_steps(model, ids)
            root = str(tmp_path_factory.mktemp(f"mg_{shape}"))
            if opt is not None:
                save_legacy(root, model, opt, args)
            else:
                path = os.path.join(root, "iter_0000007", "mp_rank_00", "model_optim_rng.pt")
                os.makedirs(os.path.dirname(path))
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7,
                            "model": model.state_dict()}, path)
                with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write("7")
            dist_root = str(tmp_path_factory.mktemp(f"mgd_{shape}"))
            save_dist(dist_root, model, args)
            runs[shape] = dict(model=model, args=args, opt=opt, root=root, dist_root=dist_root,
                               logits=megatron_logits(model, ids)[..., :VOCAB])
    return dict(runs=runs, ids=ids, tmp=tmp_path_factory)


def save_sharded(rank: int, root: str, ids) -> list:
    """A spawned rank of a 2-process world: each shape built by megatron-core at tp=2 and
    again at ep=2 (its own TP split and expert placement), saved as Megatron-LM's legacy files
    (`mp_rank_0{t}` / `mp_rank_00_00{e}`, stage state dicts as the ranks hold them) under
    `root/<shape>_<tp2|ep2>`; returns megatron-core's full logits of each."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    out = []
    for tp, ep in ((2, 1), (1, 2)):
        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        try:
            with cpu_stubs(), moe_stubs():
                for i, shape in enumerate(SHAPES):
                    model = build(shape, seed=10 * i)
                    part = megatron_logits(model, ids).contiguous()
                    if tp > 1:  # the vocabulary-parallel logits of each TP rank
                        parts = [torch.empty_like(part) for _ in range(tp)]
                        dist.all_gather(parts, part)
                        part = torch.cat(parts, -1)
                    args = args_of(shape, model)
                    args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
                    name = f"mp_rank_{rank:02d}" if tp > 1 else f"mp_rank_00_{rank:03d}"
                    folder = os.path.join(root, f"{shape}_{'tp2' if tp > 1 else 'ep2'}")
                    path = os.path.join(folder, "iter_0000007", name, "model_optim_rng.pt")
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7,
                                "model": model.state_dict()}, path)
                    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
                        f.write("7")
                    out.append((os.path.basename(folder), part[..., :VOCAB].numpy()))
        finally:
            parallel_state.destroy_model_parallel()
    return out
