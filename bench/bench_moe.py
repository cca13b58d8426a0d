"""Mixture of experts, side by side in one run (CPU time of one thread, interleaved rounds):

  step     one training step of a Mixtral-shaped model, megazoo (`forward_backward` + ZeRO-0
           optimizer step, aux loss on) vs transformers' `MixtralForCausalLM` (forward with
           `output_router_logits` so its aux loss is on too, fp32 cross-entropy, backward,
           clip_grad_norm_, fused AdamW), the same weights (first losses printed agree), fp32
           and bf16 (megazoo: bf16 weights, fp32 master; HF: fp32 weights under autocast).
  roofline the step's FLOPs at this core's matmul rate in that dtype (nothing else counted): the
           most tokens/s any implementation could reach, and so the largest ratio possible.
  experts  the expert MLPs of one layer, forward + backward: megazoo's batched matmul over tokens
           sorted by expert vs a per-expert loop (HF's gather / matmul / index_add), same routing.
  ep       4 gloo ranks: the MoE model with its 8 experts split over ep = 4 (tokens travel by
           all-to-all) vs a dense model of the same active parameters (ffn = top-k x expert
           width) under plain data parallelism 4; ZeRO-1 both; CPU seconds per step per rank,
           and the all-to-all bytes one rank sends per step.

    python -m bench.bench_moe                  # 1-5 min on 2 cores
    python -m bench.bench_moe --rounds 2 --skip-ep

Writes bench/results/moe.json and moe.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F

from megazoo.models.mixtral import adapter as mixtral
from megazoo.models.mixtral.model import MixtralModel
from megazoo.models.moe import moe_layers
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.training.run.step import activation_shape, forward_backward

RESULTS = os.path.join(ROOT, "bench", "results")
LR = 1e-4


def hf_model(a):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                        num_key_value_heads=a.heads // 4, num_local_experts=a.experts,
                        num_experts_per_tok=a.topk, max_position_embeddings=a.seq,
                        router_aux_loss_coef=0.01, output_router_logits=True,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).train()


def cpu_timed(fn) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


# ---- step: megazoo vs transformers --------------------------------------------------------------
def step_variants(a, dtype: str):
    hf = hf_model(a)
    cfg = mixtral.config_from_hf(hf.config)
    topo = ParallelTopology.single()
    mz = MixtralModel(cfg, topo)
    from megazoo.parallel.sharding import load_full_state_dict
    load_full_state_dict(mz, mixtral.from_hf_state_dict(hf.state_dict(), cfg), topo)
    opt = build_optimizer(mz, topo, OptimizerConfig(lr=LR, clip_grad=1.0),
                          torch.bfloat16 if dtype == "bf16" else torch.float32)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    shape = activation_shape(topo, a.seq, a.batch, a.hidden)
    hopt = torch.optim.AdamW(hf.parameters(), lr=LR, fused=True)
    losses = {}

    def megazoo():
        losses.setdefault("megazoo", forward_backward(
            [mz], [{"tokens": ids, "labels": labels}], topo, opt, schedule="1f1b", shape=shape))
        opt.step()
        opt.zero_grad()

    def transformers():
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            out = hf(ids)  # HF's own loss shifts labels; ours are shifted already
        lm = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
        losses.setdefault("transformers", lm.item())
        (lm + hf.config.router_aux_loss_coef * out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hopt.step()
        hopt.zero_grad()
    return {"megazoo": megazoo, "transformers": transformers}, losses


# ---- roofline: the fastest any implementation could run the step on this CPU ------------------
def roofline(a, dtype: str) -> dict:
    """The step's FLOPs (forward + backward, causal attention at half the square) at the rate
    this core reaches on one large matmul of the model's own shape in `dtype`, nothing else
    counted: an upper bound on tokens/s for megazoo and transformers alike."""
    from megazoo.models.config import TransformerConfig
    cfg = TransformerConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                            num_attention_heads=a.heads, num_query_groups=a.heads // 4,
                            activation="swiglu", bias=False, num_experts=a.experts,
                            moe_router_topk=a.topk, moe_ffn_hidden_size=a.ffn)
    dense, attention, logits = cfg.forward_flops_per_token(a.seq)
    flops = 3 * (dense + attention / 2 + logits) * a.batch * a.seq
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    x = torch.randn(a.batch * a.seq * a.topk, a.hidden, dtype=dt)
    w = torch.randn(2 * a.ffn, a.hidden, dtype=dt)
    F.linear(x, w)
    t = min(cpu_timed(lambda: F.linear(x, w))[0] for _ in range(10))  # the best: a generous ceiling
    rate = 2 * x.shape[0] * w.shape[0] * a.hidden / t
    return dict(step_flops=flops, matmul_flops_per_s=rate, tokens_per_s=a.batch * a.seq * rate / flops)


# ---- experts: batched matmul vs a loop --------------------------------------------------------
def expert_variants(a, dtype: str):
    from megazoo.models.config import TransformerConfig
    from megazoo.models.init import Initializer
    from megazoo.models.moe import MoELayer
    cfg = TransformerConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=1,
                            num_attention_heads=a.heads, activation="swiglu", bias=False,
                            num_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.ffn,
                            params_dtype="bfloat16" if dtype == "bf16" else "float32")
    layer = MoELayer(cfg, ParallelTopology.single(), Initializer(cfg), "layers.0.mlp.")
    x = torch.randn(a.batch * a.seq, a.hidden, dtype=cfg.dtype, requires_grad=True)
    logits = F.linear(x, layer.router).float()
    weights, chosen = layer.route(logits.detach())
    w1, w2 = layer.experts.weight1, layer.experts.weight2

    def batched():
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=a.experts)
        token = order // a.topk
        y = layer.experts(x[token], counts) * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        torch.zeros_like(x).index_add(0, token, y).sum().backward()

    def loop():
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, a.experts).permute(2, 1, 0)
        for e in range(a.experts):
            pos, token = torch.where(mask[e])
            gate, up = F.linear(x[token], w1[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, pos, None].to(x.dtype)
            out = out.index_add(0, token, y)
        out.sum().backward()
    return {"batched": batched, "loop": loop}


def run_rounds(variants: dict, rounds: int) -> dict:
    for fn in variants.values():  # warm up
        fn()
    names, times = list(variants), {n: [] for n in variants}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(cpu_timed(variants[n])[0])
    return {n: statistics.median(t) for n, t in times.items()}


# ---- ep: all-to-all vs dense data parallelism -------------------------------------------------
def _ep_worker(rank, a, kind, steps):
    torch.set_num_threads(1)
    from megazoo.models.presets import preset
    from megazoo.models.registry import build_model
    base = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                num_attention_heads=a.heads, num_query_groups=a.heads // 4,
                max_position_embeddings=a.seq)
    if kind == "moe":
        cfg, par = preset("moe-tiny", **base, num_experts=a.experts, moe_router_topk=a.topk,
                          moe_ffn_hidden_size=a.ffn), ParallelConfig(ep=4)
    else:
        cfg, par = preset("moe-tiny", **base, family="llama", num_experts=None,
                          moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0,
                          ffn_hidden_size=a.topk * a.ffn), ParallelConfig()
    topo = ParallelTopology.from_config(par)
    model = build_model(cfg, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=1, lr=LR))
    g = torch.Generator().manual_seed(rank)
    mb = a.batch // 4 or 1
    tokens = torch.randint(0, a.vocab, (mb, a.seq + 1), generator=g)
    batch = [{"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}]
    shape = activation_shape(topo, a.seq, mb, a.hidden)
    times = []
    for i in range(steps + 1):
        t = cpu_timed(lambda: (forward_backward([model], batch, topo, opt, schedule="1f1b",
                                                shape=shape), opt.step(), opt.zero_grad()))[0]
        if i:
            times.append(t)
    # bytes this rank sends by all-to-all per step: per MoE layer, dispatch + combine forward and
    # their two backward transposes, of the T*k rows (the (ep-1)/ep leaving the rank)
    rows = mb * a.seq * a.topk * 3 / 4
    sent = 4 * len(moe_layers(model)) * rows * a.hidden * 4 if kind == "moe" else 0
    return statistics.median(times), sent, cfg.num_parameters(active=True), cfg.num_parameters()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-ep", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "moe"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    tokens = a.batch * a.seq
    result = dict(config=dict(vars(a), out=os.path.relpath(a.out, ROOT)), torch=torch.__version__,
                  step={}, experts={})
    for dtype in ("fp32", "bf16"):
        variants, losses = step_variants(a, dtype)
        t = run_rounds(variants, a.rounds)
        row = {k: tokens / v for k, v in t.items()}
        row.update(ratio=row["megazoo"] / row["transformers"], first_losses=losses)
        roof = roofline(a, dtype)
        row.update(roofline=roof, ceiling_ratio=roof["tokens_per_s"] / row["transformers"])
        result["step"][dtype] = row
        print(f"step {dtype}: megazoo {row['megazoo']:.0f} tokens/CPU-s, transformers "
              f"{row['transformers']:.0f} ({row['ratio']:.2f}x); first LM losses {losses}", flush=True)
        print(f"  roofline {dtype}: {roof['step_flops'] / 1e9:.1f} GFLOP per step at "
              f"{roof['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s (one matmul, this core) = "
              f"{roof['tokens_per_s']:.0f} tokens/s at most: {row['ceiling_ratio']:.2f}x "
              f"transformers is the ceiling for any implementation", flush=True)
        t = run_rounds(expert_variants(a, dtype), a.rounds)
        result["experts"][dtype] = dict(t, speedup=t["loop"] / t["batched"])
        print(f"experts {dtype}: batched {t['batched'] * 1e3:.1f} ms, loop {t['loop'] * 1e3:.1f} ms "
              f"({t['loop'] / t['batched']:.2f}x)", flush=True)
    if not a.skip_ep:
        from tests.distributed import run_distributed
        result["ep"] = {}
        for kind in ("moe", "dense"):
            out = run_distributed(_ep_worker, 4, a, kind, a.rounds, timeout=900)
            step = statistics.median(o[0] for o in out)
            result["ep"][kind] = dict(step_cpu_s=step, all_to_all_bytes_per_rank=out[0][1],
                                      active_params=out[0][2], total_params=out[0][3])
            print(f"ep {kind}: {step:.3f} CPU-s per step per rank, all-to-all "
                  f"{out[0][1] / 2**20:.1f} MiB sent per rank, {out[0][2] / 1e6:.2f}M active / "
                  f"{out[0][3] / 1e6:.2f}M total parameters", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.out + ".png")
    print("wrote", a.out + ".json", a.out + ".png")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = 3 if "ep" in result else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6))
    dtypes = list(result["step"])
    for ax, (key, names, unit) in zip(axes, (("step", ("megazoo", "transformers"), "tokens / CPU-s"),
                                             ("experts", ("batched", "loop"), "ms / fwd+bwd"))):
        for j, n in enumerate(names):
            vals = [result[key][d][n] * (1e3 if key == "experts" else 1) for d in dtypes]
            ax.bar([i + 0.4 * j for i in range(len(dtypes))], vals, 0.4, label=n)
        ax.set_xticks([i + 0.2 for i in range(len(dtypes))], dtypes)
        ax.set_ylabel(unit)
        ax.legend()
    # the most any implementation could do on this core: a line where it fits beside the bars,
    # else a note (AMX bf16's ceiling is ~10x the bars)
    top = 1.35 * max(result["step"][d][n] for d in dtypes for n in ("megazoo", "transformers"))
    for i, d in enumerate(dtypes):
        ceiling = result["step"][d].get("roofline", {}).get("tokens_per_s")
        ratio = result["step"][d]["ratio"]
        axes[0].text(i + 0.2, 1.02 * max(result["step"][d]["megazoo"], result["step"][d]["transformers"]),
                     f"{ratio:.2f}x", ha="center", fontsize=9)
        if ceiling and ceiling <= 2 * top:
            axes[0].hlines(ceiling, i - 0.2, i + 0.6, colors="k", linestyles="--")
            axes[0].text(i + 0.2, ceiling, f"roofline {ceiling / 1e3:.1f}k", ha="center",
                         va="bottom", fontsize=7)
            top = max(top, 1.4 * ceiling)
        elif ceiling:
            axes[0].text(i + 0.2, 0.9 * top, f"roofline\n{ceiling / 1e3:.0f}k (off scale)",
                         ha="center", va="top", fontsize=7)
    axes[0].set_ylim(top=top)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[0].set_title("Mixtral-shaped training step")
    axes[1].set_title("expert MLPs of one layer")
    if "ep" in result:
        ep = result["ep"]
        axes[2].bar(["ep4 (all-to-all)", "dense dp4"], [ep["moe"]["step_cpu_s"], ep["dense"]["step_cpu_s"]])
        axes[2].set_ylabel("CPU-s per step per rank")
        axes[2].set_title("same active parameters, 4 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
