"""Plan a training run: per-GPU memory, step time and MFU of layouts, ranked (training/planning/planner.py).

Only layouts the trainer accepts are ranked: each is checked by train_*.py's own flag validation.

    # rank every layout of gpt-175b on 1024 A100-80GB that fits
    python tools/plan.py --model gpt-175b --cluster dgx-a100-80gb --gpus 1024 \\
        --global-batch-size 1536 --seq-length 2048 --top 10
    # one layout, broken down
    python tools/plan.py --model bloom-176b --cluster jean-zay-a100-80gb --gpus 384 \\
        --tp 4 --pp 12 --zero-stage 1 --recompute full --micro-batch-size 2 --global-batch-size 2048
    # your own model and cluster
    python tools/plan.py --hidden-size 4096 --num-layers 32 --num-attention-heads 32 \\
        --gpus 64 --gpus-per-node 8 --gpu-memory-gb 80 --peak-tflops 989 \\
        --intra-node-gbps 370 --inter-node-gbps 50 --global-batch-size 512
    # a mixture of experts: the expert-parallel size is searched unless pinned
    python tools/plan.py --model mixtral-8x7b --cluster dgx-h100-80gb --gpus 64 \\
        --global-batch-size 256 --seq-length 4096 --expert-model-parallel-size 8
    # predicted vs published runs (the table in docs/planner.md)
    python tools/plan.py --published

It first prints what it assumes (sequence, batch, dtype, GPU, interconnect; "default" marks a
value no flag set), and after the ranking the torchrun command that trains the best layout.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys

from megazoo.models.config import TransformerConfig
from megazoo.models.presets import PRESETS, preset
from megazoo.models.recompute import GRANULARITIES
from megazoo.parallel.zero.config import OptimizerConfig
from megazoo.training.planning.planner import (MATMUL_EFFICIENCY, Cluster, Layout, PlanError, plan,
                              rank_layouts)
from megazoo.training.config.flags import DTYPE_FLAGS, to_run_config
from megazoo.training.config.layout_flags import BY_FIELD, add_layout_flags, given, layout_argv
from megazoo.training.config.parser import build_parser
from megazoo.training.planning.hybrid_balance import describe_split, proposed_split
from megazoo.training.planning.reference_runs import CLUSTERS, GiB, published_runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"preset: {', '.join(sorted(PRESETS))}")
    for flag in ("--hidden-size", "--num-layers", "--num-attention-heads", "--ffn-hidden-size",
                 "--vocab-size", "--num-query-groups"):
        m.add_argument(flag, type=int)
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default="dgx-a100-80gb", choices=sorted(CLUSTERS))
    c.add_argument("--gpus", "--world-size", dest="gpus", type=int,
                   help="number of GPUs (default: one node)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU")
    c.add_argument("--peak-tflops", type=float, help="dense 16-bit peak per GPU")
    c.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU, all-reduce bus bandwidth")
    c.add_argument("--inter-node-gbps", type=float, help="GB/s per GPU across nodes")
    # the trainer's layout flags (--tp, --pp ... as short forms); dp follows from --gpus
    lay = add_layout_flags(p, fields=set(BY_FIELD) - {"dp", "layers_per_virtual_stage"},
                           searched=True,
                           title="layout (any given value is pinned; tp, pp, vpp, ep, zero stage "
                                 "and sequence parallelism are searched, the rest default)")
    lay.add_argument("--recompute", choices=["none", *GRANULARITIES])
    lay.add_argument("--micro-batch-size", type=int)
    lay.add_argument("--global-batch-size", type=int, help=f"default {DEFAULTS['global_batch_size']}")
    lay.add_argument("--seq-length", type=int, help=f"default {DEFAULTS['seq_length']}")
    lay.add_argument("--precision", choices=sorted(PARAMS_DTYPE), help=f"default {DEFAULTS['precision']}")
    lay.add_argument("--grad-bytes", type=int, choices=[2, 4], default=4)
    lay.add_argument("--flash-attention", action="store_true")
    lay.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                     help="the optimizer's states: AdamW's two moments, or Muon's one momentum "
                          "for the hidden matrices (AdamW for the rest)")
    lay.add_argument("--overlap-dp", action="store_true")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--published", action="store_true", help="predicted vs published runs")
    a = p.parse_args(argv)
    a.defaulted = [k for k, v in DEFAULTS.items() if getattr(a, k) is None]
    for k in a.defaulted:
        setattr(a, k, DEFAULTS[k])
    return a


# The layout fields the planner searches unless a flag pins them
SEARCHED = ("tp", "pp", "vpp", "ep", "zero_stage", "sequence_parallel")
# What the plan assumes when no flag says otherwise (printed as "default" by `assumptions`).
DEFAULTS = dict(seq_length=2048, global_batch_size=512, precision="bf16")
PARAMS_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}  # --precision -> TransformerConfig.params_dtype


def assumptions(a, cluster: Cluster) -> str:
    """One paragraph: every input of the prediction that is not the model or the layout."""
    def said(key: str, text: str, flag: str) -> str:
        return f"{text} ({'default; set with ' if key in a.defaulted else ''}{flag})"
    dtype = "fp32 weights, activations and gradients" if a.precision == "fp32" else \
        f"bf16 weights and activations, fp32 master weights, {8 * a.grad_bytes}-bit gradients"
    return ("assumptions: " + "; ".join([
        said("seq_length", f"sequence {a.seq_length} tokens", "--seq-length"),
        said("global_batch_size", f"global batch {a.global_batch_size} sequences",
             "--global-batch-size"),
        said("precision", dtype, "--precision, --grad-bytes"),
        f"GPU: {cluster.memory_bytes / GiB:.0f} GiB ({100 * cluster.usable_fraction:.0f}% usable), "
        f"{cluster.peak_flops / 1e12:.0f} TFLOP/s dense 16-bit peak, {cluster.gpus_per_node} per "
        f"node ({cluster.name}; --gpu-memory-gb, --peak-tflops, --gpus-per-node)",
        f"interconnect: {cluster.intra_node_bw / 1e9:.0f} GB/s per GPU inside a node, "
        f"{cluster.inter_node_bw / 1e9:.1f} GB/s per GPU across nodes, all-reduce bus bandwidth "
        f"(--intra-node-gbps, --inter-node-gbps)",
        f"attention {'without' if not a.flash_attention else 'with'} a fused kernel "
        f"(--flash-attention), data-parallel reduction {'not ' if not a.overlap_dp else ''}"
        f"overlapped with backward (--overlap-dp)"]) + ".")


def build_model(a) -> TransformerConfig:
    overrides = {k: v for k, v in dict(
        hidden_size=a.hidden_size, num_layers=a.num_layers, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, vocab_size=a.vocab_size,
        num_query_groups=a.num_query_groups, max_position_embeddings=a.seq_length).items()
        if v is not None}
    if a.model:
        return preset(a.model, **overrides)
    if not {"hidden_size", "num_layers", "num_attention_heads"} <= set(overrides):
        sys.exit("give --model, or --hidden-size, --num-layers and --num-attention-heads")
    return TransformerConfig(**overrides)


def build_cluster(a) -> Cluster:
    base = CLUSTERS[a.cluster]
    changes = {k: v for k, v in dict(
        num_gpus=a.gpus or base.num_gpus, gpus_per_node=a.gpus_per_node,
        memory_bytes=a.gpu_memory_gb * GiB if a.gpu_memory_gb else None,
        peak_flops=a.peak_tflops * 1e12 if a.peak_tflops else None,
        intra_node_bw=a.intra_node_gbps * 1e9 if a.intra_node_gbps else None,
        inter_node_bw=a.inter_node_gbps * 1e9 if a.inter_node_gbps else None).items() if v is not None}
    return base.replace(**changes)


def trainer_argv(cfg: TransformerConfig, lay: Layout) -> list[str]:
    """The train_gpt.py flags of this model and layout (mock data, one iteration)."""
    argv = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size,
            "--num-attention-heads", cfg.num_attention_heads, "--ffn-hidden-size", cfg.ffn_hidden_size,
            "--vocab-size", cfg.vocab_size, "--max-position-embeddings", cfg.max_position_embeddings,
            "--seq-length", lay.seq_length,
            *layout_argv(lay.parallel, zero_stage=lay.optimizer.zero_stage),
            "--micro-batch-size", lay.micro_batch_size, "--global-batch-size", lay.global_batch_size,
            "--mock-data", "--train-iters", 1]
    if cfg.num_experts:
        argv += ["--num-experts", cfg.num_experts, "--moe-router-topk", cfg.moe_router_topk,
                 "--moe-ffn-hidden-size", cfg.moe_ffn_hidden_size,
                 "--moe-layer-freq", cfg.moe_layer_freq]
        if cfg.moe_shared_expert_intermediate_size:
            argv += ["--moe-shared-expert-intermediate-size",
                     cfg.moe_shared_expert_intermediate_size]
    if cfg.num_query_groups:
        argv += ["--group-query-attention", "--num-query-groups", cfg.num_query_groups]
    if lay.recompute_granularity is not None:
        argv += ["--recompute-granularity", lay.recompute_granularity]
    if lay.optimizer.optimizer != OptimizerConfig.optimizer:
        argv += ["--optimizer", lay.optimizer.optimizer]
    if lay.params_dtype in DTYPE_FLAGS:
        argv.append(f"--{DTYPE_FLAGS[lay.params_dtype]}")
    return [str(x) for x in argv]


def train_script(cfg: TransformerConfig) -> str:
    """The reference script whose model class trains this configuration."""
    if cfg.num_experts:
        return "train_moe.py"
    if cfg.qk_layernorm or cfg.add_qkv_bias:
        return "train_qwen.py"
    if cfg.position_embedding == "alibi":
        return "train_bloom.py"
    if cfg.position_embedding == "rope":
        return "train_llama.py"
    return "train_gpt.py"


def launch_command(a, cfg: TransformerConfig, lay: Layout, cluster: Cluster) -> str:
    """The torchrun command that trains `lay` (Megatron flag names; upper case: yours to fill)."""
    flags = trainer_argv(cfg, lay)
    flags = flags[:flags.index("--mock-data")] + flags[flags.index("--train-iters") + 2:]
    if a.model:
        flags = ["--model", a.model] + flags
    flags += ["--data-path", "DATA_PREFIX", "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", "TOKENIZER_FOLDER", "--train-iters", "TRAIN_ITERS",
              "--save", "CHECKPOINTS", "--save-interval", "1000", "--load", "CHECKPOINTS"]
    nodes = math.ceil(lay.world / cluster.gpus_per_node)
    launcher = ["torchrun", "--nproc-per-node", str(min(lay.world, cluster.gpus_per_node))]
    if nodes > 1:
        launcher += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     "MASTER_HOST:29500"]
    lines: list[list[str]] = [[]]
    for word in launcher + [train_script(cfg)] + flags:  # a flag opens a line once it is long
        if word.startswith("--") and len(" ".join(lines[-1])) > 60:
            lines.append([])
        lines[-1].append(shlex.quote(word))
    return " \\\n    ".join(" ".join(line) for line in lines)


def trainer_refusal(cfg: TransformerConfig, lay: Layout, parser=None) -> str | None:
    """Why the trainer would refuse this layout (its own flag validation), or None if it accepts it."""
    try:
        args = (parser or build_parser()).parse_args(trainer_argv(cfg, lay))
        to_run_config(args, world_size=lay.world)
    except ValueError as e:  # ArgumentError, LayoutError, ZeroConfigError
        return str(e)
    return None


def row(p) -> str:
    m, t = p.memory, p.time
    return (f"{p.layout.describe():52} {m.params / GiB:6.1f} {m.grads / GiB:6.1f} "
            f"{m.optimizer / GiB:6.1f} {m.activations / GiB:6.1f} {m.total / GiB:7.1f} "
            f"{t.total:8.2f} {t.tflops_per_gpu:7.1f} {100 * t.mfu:5.1f}%")


HEADER = (f"{'layout':52} {'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'GiB':>7} "
          f"{'step s':>8} {'TFLOP/s':>7} {'MFU':>6}")


def published_table() -> str:
    lines = ["| run | layout | GPUs | params | predicted GiB/GPU | fits | published TFLOP/s/GPU | "
             "predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in published_runs():
        p = plan(r.model, r.layout, r.cluster)
        cfg = r.model
        params = f"{cfg.num_parameters() / 1e9:.1f}B" + (
            f" ({cfg.num_parameters(active=True) / 1e9:.1f}B active)" if cfg.num_experts else "")
        published = "memory only" if r.tflops_per_gpu is None else f"{r.tflops_per_gpu:.0f}"
        err = "" if r.tflops_per_gpu is None else \
            f"{100 * (p.time.tflops_per_gpu / r.tflops_per_gpu - 1):+.0f}%"
        lines.append(f"| {r.name} | {r.layout.describe()} | {r.cluster.num_gpus} | {params} | "
                     f"{p.memory.total / GiB:.1f} | {'yes' if p.fits else 'NO'} | {published} | "
                     f"{p.time.tflops_per_gpu:.0f} | {err} |")
    return "\n".join(lines)


def print_split(cfg: TransformerConfig, lay: Layout) -> None:
    """The balanced pipeline split the planner chose for a hybrid model, as the flag."""
    if lay.parallel.stage_layout is not None and proposed_split(
            cfg, lay.replace(stage_layout=None)) == lay:
        print(f"pipeline split at balanced cost (layer kinds by their FLOPs): "
              f"{describe_split(cfg, lay)}")


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.published:
        print(f"MATMUL_EFFICIENCY = {MATMUL_EFFICIENCY}\n")
        print(published_table())
        return
    cfg, cluster = build_model(a), build_cluster(a)
    print(assumptions(a, cluster))
    fixed = {k: v for k, v in dict(
        **{f: given(a, f) for f in SEARCHED}, recompute_granularity=a.recompute,
        micro_batch_size=a.micro_batch_size).items() if v is not None}
    if a.recompute == "none":  # the trainer's spelling of no recompute: no granularity
        fixed["recompute_granularity"] = None
    cp = given(a, "cp") or 1
    base = Layout.of(cp=cp, cp_comm_type=given(a, "cp_comm_type") or "p2p",
                     params_dtype=PARAMS_DTYPE[a.precision],
                     optimizer=OptimizerConfig(optimizer=a.optimizer),
                     grad_dtype="fp32" if a.grad_bytes == 4 else "model",
                     flash_attention=a.flash_attention, overlap_dp=a.overlap_dp,
                     first_stage_layers=given(a, "first_stage_layers"),
                     last_stage_layers=given(a, "last_stage_layers"),
                     stage_layout=given(a, "stage_layout"),
                     global_batch_size=a.global_batch_size, seq_length=a.seq_length)
    if cfg.num_experts:
        print(f"mixture of experts: {cfg.num_parameters(active=True) / 1e9:.2f}B of the "
              f"{cfg.num_parameters() / 1e9:.2f}B parameters active per token (FLOPs and MFU "
              f"count these); each rank holds num_experts / ep experts per MoE layer")
    print(f"model: {cfg.num_parameters() / 1e9:.2f}B parameters (h={cfg.hidden_size}, "
          f"L={cfg.num_layers}, heads={cfg.num_attention_heads}, V={cfg.vocab_size}); cluster: "
          f"{cluster.num_gpus} x {cluster.memory_bytes / GiB:.0f} GiB, "
          f"{cluster.peak_flops / 1e12:.0f} TFLOP/s peak")
    if {"tp", "pp", "zero_stage", "recompute_granularity", "micro_batch_size"} <= set(fixed) and \
            ("ep" in fixed or not cfg.num_experts):
        dp = cluster.num_gpus // (fixed["tp"] * fixed["pp"] * cp)
        layout = proposed_split(cfg, base.replace(dp=dp, **fixed))
        try:
            p = plan(cfg, layout, cluster)
        except PlanError as e:
            sys.exit(f"invalid layout: {e}")
        print(HEADER + "\n" + row(p))
        t = p.time
        print(f"fits: {p.fits} ({p.memory.stage} stage);  time: compute {t.compute:.2f} s, TP "
              f"{t.tp_comm:.2f}, CP ring {t.cp_comm:.2f}, EP all-to-all {t.ep_comm:.2f}, PP p2p "
              f"{t.pp_comm:.2f}, bubble {t.bubble:.2f}, DP {t.dp_comm:.2f}, "
              f"optimizer {t.optimizer:.3f};  {t.tokens_per_s:,.0f} tokens/s")
        print_split(cfg, layout)
        refusal = trainer_refusal(cfg, layout)
        if refusal:
            print(f"note: train_*.py refuses this layout: {refusal}")
        else:
            print(f"launch ({layout.world} GPUs):\n{launch_command(a, cfg, layout, cluster)}")
        return
    parser = build_parser()
    plans = [p for p in rank_layouts(cfg, cluster, base, fixed)
             if trainer_refusal(cfg, p.layout, parser) is None]  # only what train_*.py accepts
    if not plans:
        sys.exit("no layout fits: add GPUs, memory, recompute or ZeRO, or shrink the batch")
    print(f"{len(plans)} layouts fit; the fastest {min(a.top, len(plans))}:\n{HEADER}")
    for p in plans[:a.top]:
        print(row(p))
    best = plans[0].layout
    print_split(cfg, best)
    print(f"launch the fastest (the first row, {best.world} GPUs):\n"
          f"{launch_command(a, cfg, best, cluster)}")


if __name__ == "__main__":
    main()
