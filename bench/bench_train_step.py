"""Single-process training step: megazoo GPT/BLOOM against Hugging Face transformers, side by side.

One step = forward + backward + gradient clipping (1.0) + AdamW, on the same configuration, the
same weights (copied through the HF name mappings; the first losses printed must agree), the
same tokens, the same thread count (default 1) and dtype. Variants, all alive in one process
and timed in interleaved rounds (each round runs every variant once, rotating who goes first):

  fp32   megazoo: `training.run.step.forward_backward` then the optimizer step (what `pretrain` runs: pipeline engine
         with no pipelining, ZeRO optimizer stage 0), timed apart: forward_backward, then update
         (optimizer.step + zero_grad); HF is split the same way (backward | clip + AdamW).  HF: `model(ids)` + the same fp32 cross-entropy,
         `clip_grad_norm_`, `torch.optim.AdamW(fused=True)` (HF Trainer's default optimizer
         with torch >= 2.8, "adamw_torch_fused").
  bf16   megazoo: the ZeRO optimizer with dtype=torch.bfloat16: bf16 weights and activations, fp32
         gradient buffers, fp32 master weights.  HF runs two recipes and the ratio is taken
         against the FASTER one, so it never flatters megazoo:
           hf-bf16-master  model.to(bfloat16) + fp32 master copies (Megatron/DeepSpeed style);
           hf-autocast     fp32 weights under torch.autocast("cpu", bfloat16) (Trainer --bf16).

Timing is CPU time of this process (time.process_time), not wall time: the machine is shared
with other jobs, and with one thread CPU time is the wall time the step would take on an idle
core, while wall time swings 2x with the neighbours' load (it is recorded too). The matmul peak
(square 1024 matmuls, fp32 and bf16, this thread) is sampled between rounds the same way; MFU =
model FLOPs (training/monitor/metrics.py: 3x forward, no recompute) x tokens per CPU-second / peak.

    python -m bench.bench_train_step              # both models, fp32 + bf16: ~6 min on 2 cores
    python -m bench.bench_train_step --models gpt --dtypes fp32 --rounds 3   # quick look
    python -m bench.bench_train_step --profile    # + torch.profiler top ops per variant

Writes bench/results/train_step.json and train_step.png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from megazoo.models.bloom import adapter as mz_bloom
from megazoo.models.gpt2 import adapter as mz_gpt
from megazoo.models.bloom.model import BloomModel
from megazoo.models.config import TransformerConfig
from megazoo.models.gpt2.model import GPTModel
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.training.run.step import activation_shape, forward_backward

RESULTS = os.path.join(ROOT, "bench", "results")
LR, WD, CLIP = 1e-4, 0.01, 1.0


def model_config(arch: str, args) -> TransformerConfig:
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                  num_attention_heads=args.heads, max_position_embeddings=args.seq,
                  make_vocab_size_divisible_by=128)
    if arch == "gpt":
        return TransformerConfig(position_embedding="learned", **common)
    return TransformerConfig(position_embedding="alibi", embedding_layernorm=True, **common)


# ---- the variants: forward+backward and the update, timed separately -------------------------

@dataclass
class Step:
    """One variant's training step, split where the phases are timed apart."""
    forward_backward: Callable  # (ids, labels) -> float loss; gradients ready
    update: Callable  # () -> None: clipping, the optimizer, zeroing gradients

    def __call__(self, ids, labels) -> float:
        loss = self.forward_backward(ids, labels)
        self.update()
        return loss


def megazoo_step(arch: str, cfg: TransformerConfig, precision: str, init_sd) -> Step:
    """What `pretrain` runs per step: forward_backward, then optimizer.step + zero_grad."""
    topo = ParallelTopology.single()
    model = (GPTModel if arch == "gpt" else BloomModel)(cfg, topo)
    model.load_state_dict(init_sd)
    opt = build_optimizer(model, topo, OptimizerConfig(
        zero_stage=0, lr=LR, weight_decay=WD, clip_grad=CLIP),
        torch.bfloat16 if precision == "bf16" else torch.float32)
    last = {}

    def fb(ids, labels):
        b, s = ids.shape
        last["loss"] = forward_backward([model], [{"tokens": ids, "labels": labels}], topo, opt,
                                        schedule="1f1b",
                                        shape=activation_shape(topo, s, b, cfg.hidden_size))
        return last["loss"]

    def update():
        opt.step(loss=last["loss"])
        opt.zero_grad()
    return Step(fb, update)


def hf_model(arch: str, cfg: TransformerConfig, init_sd):
    from transformers import BloomForCausalLM, GPT2LMHeadModel
    mod = mz_gpt if arch == "gpt" else mz_bloom
    hf_cfg = mod.hf_config(cfg)
    model = (GPT2LMHeadModel if arch == "gpt" else BloomForCausalLM)(hf_cfg)
    sd = {k: v for k, v in mod.to_hf_state_dict(init_sd, cfg).items()}
    # megazoo pads the vocabulary to a multiple of 128; HF keeps the exact size
    key = "transformer.wte.weight" if arch == "gpt" else "transformer.word_embeddings.weight"
    sd[key] = sd[key][:cfg.vocab_size]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m or "attn.bias" in m for m in missing), missing
    model.train()
    return model


def _hf_loss_direct(model, ids, labels):
    # The loss HF computes from labels (logits upcast to fp32), on megazoo's already-shifted
    # labels, so both sides predict exactly the same b * s tokens.
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def hf_fp32_step(arch, cfg, init_sd, autocast: bool = False) -> Step:
    """fp32 weights and AdamW; with `autocast`, forward under torch.autocast(bfloat16)."""
    model = hf_model(arch, cfg, init_sd)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def fb(ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = _hf_loss_direct(model, ids, labels)
        loss.backward()
        return loss.item()

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Step(fb, update)


def hf_bf16_master_step(arch, cfg, init_sd) -> Step:
    model = hf_model(arch, cfg, init_sd).to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # the fp32 masters start from the fp32 weights, not from their bf16 rounding
    fp32 = dict(hf_model(arch, cfg, init_sd).named_parameters())
    masters = [fp32[n].detach().clone() for n, _ in named]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)

    def fb(ids, labels):
        loss = _hf_loss_direct(model, ids, labels)
        loss.backward()
        return loss.item()

    def update():
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)  # fp32 -> bf16 rounding in one fused pass
    return Step(fb, update)


# ---- measurement ---------------------------------------------------------------------------

def batches(cfg, args, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def matmul_peak(dtype, n: int = 1024, seconds: float = 0.4) -> float:
    """FLOP/s of square matmuls per second of this process's CPU time (see the module doc)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b
    count, c0, w0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds or count < 3:
        a @ b
        count += 1
    return 2.0 * n ** 3 * count / (time.process_time() - c0)


def build_variants(arch: str, dtypes: list[str], args) -> tuple[TransformerConfig, dict]:
    cfg = model_config(arch, args)
    ref = (GPTModel if arch == "gpt" else BloomModel)(cfg, ParallelTopology.single())
    init_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del ref
    variants = {}
    if "fp32" in dtypes:
        variants["megazoo-fp32"] = megazoo_step(arch, cfg, "fp32", init_sd)
        variants["hf-fp32"] = hf_fp32_step(arch, cfg, init_sd)
    if "bf16" in dtypes:
        variants["megazoo-bf16"] = megazoo_step(arch, cfg, "bf16", init_sd)
        variants["hf-bf16-master"] = hf_bf16_master_step(arch, cfg, init_sd)
        variants["hf-autocast"] = hf_fp32_step(arch, cfg, init_sd, autocast=True)
    return cfg, variants


def profile_variant(name, fn, data, rows=12) -> str:
    from torch.profiler import ProfilerActivity, profile
    fn(*data[0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids, labels in data[:2]:
            fn(ids, labels)
    return f"== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_arch(arch: str, args) -> dict:
    cfg, variants = build_variants(arch, args.dtypes, args)
    data = batches(cfg, args, args.warmup + args.steps)
    first_loss = {}
    for name, fn in variants.items():  # warm-up (first calls allocate, pick kernels)
        for i in range(args.warmup):
            loss = fn(*data[i])
            first_loss.setdefault(name, float(loss))
    cpu = {name: [] for name in variants}
    wall = {name: [] for name in variants}
    fwd_bwd = {name: [] for name in variants}  # CPU s of forward + backward; the rest is the update
    names = list(variants)
    peaks = {"fp32": [], "bf16": []}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            w0, c0, fb_cpu = time.perf_counter(), time.process_time(), 0.0
            for i in range(args.steps):
                f0 = time.process_time()
                variants[name].forward_backward(*data[args.warmup + i])
                fb_cpu += time.process_time() - f0
                variants[name].update()
            cpu[name].append((time.process_time() - c0) / args.steps)
            wall[name].append((time.perf_counter() - w0) / args.steps)
            fwd_bwd[name].append(fb_cpu / args.steps)
        for dt in args.dtypes:  # the peak is sampled under the same load as the steps
            peaks[dt].append(matmul_peak(torch.float32 if dt == "fp32" else torch.bfloat16))
        print(f"  {arch} round {r + 1}/{args.rounds} (CPU s / wall s): " +
              "  ".join(f"{n} {cpu[n][-1]:.2f}/{wall[n][-1]:.2f}" for n in names), flush=True)
    tokens = args.batch * args.seq
    flops_tok = cfg.model_flops_per_token(args.seq)
    out = {"config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_layers",
                                                     "num_attention_heads", "ffn_hidden_size",
                                                     "position_embedding")},
           "model_flops_per_token": flops_tok, "first_loss": first_loss, "variants": {}}
    for dt in args.dtypes:
        out[f"matmul_peak_{dt}_flops"] = statistics.median(peaks[dt])
    for name in names:
        dt = "bf16" if ("bf16" in name or "autocast" in name) else "fp32"
        med = statistics.median(cpu[name])
        achieved = flops_tok * tokens / med
        out["variants"][name] = {
            "cpu_s": cpu[name], "wall_s": wall[name], "median_cpu_s": med,
            "median_forward_backward_cpu_s": statistics.median(fwd_bwd[name]),
            "median_update_cpu_s": statistics.median(c - f for c, f in zip(cpu[name], fwd_bwd[name])),
            "median_wall_s": statistics.median(wall[name]), "min_wall_s": min(wall[name]),
            "tokens_per_s": tokens / med, "tokens_per_wall_s": tokens / statistics.median(wall[name]),
            "model_tflops": achieved / 1e12, "mfu": achieved / out[f"matmul_peak_{dt}_flops"]}
    v = out["variants"]
    out["ratios"] = {}
    for dt in args.dtypes:
        # bf16: against the faster HF recipe, so the ratio never flatters megazoo
        hf = "hf-fp32" if dt == "fp32" else max(("hf-bf16-master", "hf-autocast"),
                                                key=lambda n: v[n]["tokens_per_s"])
        name = f"megazoo-{dt}"
        out["ratios"][dt] = {"vs": hf, "ratio": v[name]["tokens_per_s"] / v[hf]["tokens_per_s"],
                             "wall_ratio": v[name]["tokens_per_wall_s"] / v[hf]["tokens_per_wall_s"]}
    if args.profile:
        out["profile"] = {name: profile_variant(name, fn, data) for name, fn in variants.items()}
        for text in out["profile"].values():
            print(text)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    archs = list(result["models"])
    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.2), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        r = result["models"][arch]
        names = list(r["variants"])
        tps = [r["variants"][n]["tokens_per_s"] for n in names]
        colors = ["tab:blue" if n.startswith("megazoo") else "tab:gray" for n in names]
        bars = ax.bar(range(len(names)), tps, color=colors)
        for b_, n in zip(bars, names):
            ax.text(b_.get_x() + b_.get_width() / 2, b_.get_height(),
                    f"MFU {100 * r['variants'][n]['mfu']:.0f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ratios = ", ".join(f"{dt} {x['ratio']:.2f}x" for dt, x in r["ratios"].items())
        ax.set_title(f"{arch}: megazoo / transformers = {ratios}", fontsize=9)
        ax.set_ylabel("tokens per CPU-second (median)")
    fig.suptitle(f"training step, threads={result['threads']}, batch {result['args']['batch']} x "
                 f"seq {result['args']['seq']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt", "bloom"], choices=["gpt", "bloom"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="steps per timing sample")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=os.path.join(RESULTS, "train_step"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"args": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "loadavg_start": os.getloadavg(), "models": {}}
    import transformers
    result["transformers"] = transformers.__version__
    for arch in args.models:
        result["models"][arch] = run_arch(arch, args)
    result["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")
    print(f"\n{'model':6} {'variant':15} {'CPU s':>7} {'fwd+bwd':>7} {'update':>7} {'wall s':>7} "
          f"{'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6}")
    for arch, r in result["models"].items():
        for name, v in r["variants"].items():
            print(f"{arch:6} {name:15} {v['median_cpu_s']:7.3f} {v['median_forward_backward_cpu_s']:7.3f} "
                  f"{v['median_update_cpu_s']:7.3f} {v['median_wall_s']:7.3f} {v['tokens_per_s']:9.0f} "
                  f"{v['model_tflops']:8.3f} {100 * v['mfu']:5.1f}%")
        for dt in args.dtypes:
            print(f"{arch:6} matmul peak {dt}: {r[f'matmul_peak_{dt}_flops'] / 1e9:.0f} GFLOP/s")
        for dt, x in r["ratios"].items():
            print(f"{arch:6} {dt} ratio megazoo / {x['vs']}: {x['ratio']:.2f}x per CPU-second "
                  f"({x['wall_ratio']:.2f}x by median wall time)")
        print(f"{arch:6} first losses: " + ", ".join(f"{k} {v:.4f}" for k, v in r["first_loss"].items()))
    print(f"wrote {args.out}.json and .png")
    return result


if __name__ == "__main__":
    main()
