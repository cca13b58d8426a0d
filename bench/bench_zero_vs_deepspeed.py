"""megazoo ZeRO vs DeepSpeed ZeRO (and ZeRO-3 vs PyTorch FSDP2): the same GPT, ranks and batch,
side by side, on CPU (gloo).

DeepSpeed is not a megazoo dependency. Install it in a separate virtual environment that sees
the system torch, without building its C++/CUDA ops:

    python -m venv /tmp/dsvenv --system-site-packages
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed
    DS_ACCELERATOR=cpu python -m bench.bench_zero_vs_deepspeed --ds-python /tmp/dsvenv/bin/python

Each (side, stage) runs as its own world of `--world` processes, one thread each. Both sides
train `TransformerLanguageModel` from the same seed on the same token stream with `--dtype`
weights (bf16: fp32 master weights), torch's AdamW (weight decay 0; DS_BUILD_OPS=0 leaves
DeepSpeed no fused Adam) and gradient clipping 1.0. `--fsdp2` adds, at stage 3, PyTorch's
FSDP2 (`fully_shard` on each transformer layer and on the model, what a user would pick
instead; bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` over fp32 weights,
torch's default AdamW, `clip_grad_norm_`). Each rank also measures the single-thread GEMM peak
(square 1024 matmuls in the run's dtype) after its steps, and the model FLOP/s per rank
(3x forward FLOPs x tokens/s / ranks) is reported against it. Reported per stage: tokens/s
from the slowest rank's median step after warm-up (a step stalled by the host's other load
does not count; the mean over the timed steps is kept as `tokens_per_s_mean`), peak RSS per
rank (max over ranks) and its growth over the RSS just before the model was built, and the
final loss of each side as a sanity check. Each side runs `--repeats` times in alternating
order and the best throughput is kept (a shared host's other load only ever slows a run down);
the load average is recorded.

The machine's ceiling is measured as a side of its own, `bound`: `--world` processes with the
same threads, each training the same model on its own data in a world of its own (megazoo at
ZeRO-0 with one rank: no communication at all), started and timed together. Its tokens/s (all
processes, slowest one's time, as for the other sides) is what `--world` ranks could do if data
parallelism cost nothing; every row reports each side's share of it. It runs in every stage's
rotation and the best of all its runs is the bound (`--no-bound` skips it). Results go to
bench/results/zero_vs_deepspeed.{json,md,png} (`--plot-only` redraws the PNG from the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from queue import Empty

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _config(args):
    from megazoo.models.config import TransformerConfig
    return TransformerConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                            num_attention_heads=args.heads, max_position_embeddings=args.seq,
                            make_vocab_size_divisible_by=128, seed=1234)


def _model(args, topo):
    from megazoo.models.language_model import TransformerLanguageModel
    return TransformerLanguageModel(_config(args), topo)


def _dtype(args):
    import torch
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def _tokens(args, step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(step * 1000 + rank)
    t = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _train(args, rank: int, backward_step, barrier=None) -> dict:
    """Run warm-up + timed steps with `backward_step(ids, labels) -> loss`; rank-local stats.
    `barrier` lines the `--world` processes up around the timed steps (default: their world's)."""
    import torch.distributed as dist
    barrier = barrier or dist.barrier
    losses, step_times = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            barrier()
            start = time.perf_counter()
        ids, labels = _tokens(args, step, rank)
        begun = time.perf_counter()
        losses.append(backward_step(ids, labels))
        step_times.append(time.perf_counter() - begun)
    barrier()
    elapsed = time.perf_counter() - start
    tokens = args.micro_batch * args.seq * args.world  # a step, all ranks
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from bench.bench_train_step import matmul_peak  # after the steps: not in the RSS
    return dict(tokens_per_s=tokens / statistics.median(step_times[args.warmup:]),
                tokens_per_s_mean=tokens * args.steps / elapsed, peak_rss=peak_rss,
                final_loss=losses[-1], gemm_peak_flops=matmul_peak(_dtype(args)))


def _megazoo_rank(args, rank: int | None = None, barrier=None):
    """megazoo's side; with `rank` and `barrier`, one process of the bound (a world of one)."""
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    topo = ParallelTopology.from_config(ParallelConfig())
    base = _rss_now()
    model = _model(args, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(
        zero_stage=args.stage if barrier is None else 0, lr=args.lr, weight_decay=0.0,
        clip_grad=1.0, bucket_numel=args.bucket_numel), _dtype(args))

    def step(ids, labels):
        loss = model(ids, labels=labels).float().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()
    out = _train(args, topo.rank if rank is None else rank, step, barrier)
    out.update(base_rss=base, model_states=opt.memory_report()["model_states"])
    return out


def _deepspeed_rank(args):
    import deepspeed
    import torch
    from megazoo.parallel.topology import ParallelTopology
    base = _rss_now()
    model = _model(args, ParallelTopology.single())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": args.dtype == "bf16"}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": args.stage,
                                    "reduce_bucket_size": args.bucket_numel,
                                    "allgather_bucket_size": args.bucket_numel},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids, labels):
        loss = engine(ids, labels=labels).float().mean()
        engine.backward(loss)
        engine.step()
        return loss.item()
    out = _train(args, int(os.environ["RANK"]), step)
    out.update(base_rss=base)
    return out


def _fsdp2_rank(args):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from megazoo.parallel.topology import ParallelTopology
    base = _rss_now()
    model = _model(args, ParallelTopology.single())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.dtype == "bf16" else MixedPrecisionPolicy()
    for layer in model.layers.values():
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def step(ids, labels):
        loss = model(ids, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()
    out = _train(args, int(os.environ["RANK"]), step)
    out.update(base_rss=base)
    return out


def _rank_main(rank, args, port, queue, barrier=None):
    bound = args.worker == "bound"  # every process in a world of its own (its own port)
    world = 1 if bound else args.world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank % world),
                      LOCAL_RANK=str(rank % world), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if bound:
        dist.init_process_group("gloo", rank=0, world_size=1)
        queue.put((rank, _megazoo_rank(args, rank, lambda: barrier.wait(args.timeout))))
    elif args.worker == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        queue.put((rank, _deepspeed_rank(args)))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
        queue.put((rank, (_fsdp2_rank if args.worker == "fsdp2" else _megazoo_rank)(args)))
    dist.barrier()
    dist.destroy_process_group()


def _worker(args) -> None:
    """One world for one (side, stage); prints a JSON line with the per-rank results."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [_free_port() for _ in range(args.world if args.worker == "bound" else 1)]
    barrier = ctx.Barrier(args.world)  # the bound's processes share no world: time them together
    procs = [ctx.Process(target=_rank_main, args=(r, args, ports[r % len(ports)], queue, barrier))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results, waited = {}, 0.0
    while len(results) < len(procs):  # stop waiting once a rank died without a result
        try:
            r, got = queue.get(timeout=5)
            results[r] = got
        except Empty:
            waited += 5
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or waited > args.timeout:
                raise SystemExit(f"a rank exited with {dead[0]} before reporting" if dead
                                 else f"no result within --timeout {args.timeout:g} s")
    for p in procs:
        p.join()
    print("RESULT " + json.dumps([results[r] for r in range(args.world)]), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_side(args, side: str, stage: int) -> list[dict] | str:
    python = args.ds_python if side == "deepspeed" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--worker", side, "--stage", str(stage)]
    for k in ("world", "steps", "warmup", "hidden", "layers", "heads", "vocab", "seq",
              "micro_batch", "lr", "bucket_numel", "timeout", "dtype"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    path = [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"


def _summary(ranks: list[dict], flops_per_token: float) -> dict:
    tokens_per_s = min(r["tokens_per_s"] for r in ranks)
    peak = min(r["gemm_peak_flops"] for r in ranks)
    per_rank = flops_per_token * tokens_per_s / len(ranks)  # one thread (core) per rank
    return dict(tokens_per_s=tokens_per_s,
                tokens_per_s_mean=min(r["tokens_per_s_mean"] for r in ranks),
                peak_rss_mib=max(r["peak_rss"] for r in ranks) / 2 ** 20,
                rss_growth_mib=max(r["peak_rss"] - r["base_rss"] for r in ranks) / 2 ** 20,
                final_loss=sum(r["final_loss"] for r in ranks) / len(ranks),
                model_gflops_per_rank=per_rank / 1e9, gemm_peak_gflops=peak / 1e9,
                fraction_of_gemm_peak=per_rank / peak)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["megazoo", "deepspeed", "fsdp2", "bound"],
                   help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bucket-numel", type=int, default=5_000_000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--fsdp2", action="store_true", help="at stage 3, PyTorch FSDP2 as a third side")
    p.add_argument("--no-deepspeed", action="store_true", help="megazoo against FSDP2 only")
    p.add_argument("--no-bound", action="store_true",
                   help="skip the ceiling (each rank alone, no communication)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side; best throughput kept")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "zero_vs_deepspeed"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    if args.plot_only:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        return plot(saved["rows"], args.out + ".png", saved.get("bound"))

    rows, bound_runs = [], []
    load_before = os.getloadavg()
    flops_per_token = _config(args).model_flops_per_token(args.seq)
    for stage in args.stages:
        row = {"stage": stage}
        sides = ["megazoo"] + ([] if args.no_deepspeed else ["deepspeed"]) + \
            (["fsdp2"] if args.fsdp2 and stage == 3 else []) + ([] if args.no_bound else ["bound"])
        runs: dict[str, list] = {side: [] for side in sides}
        for rep in range(args.repeats):
            # Rotate the order so that a change in background load hits every side alike.
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                got = _run_side(args, side, stage)
                runs[side].append(_summary(got, flops_per_token) if isinstance(got, list) else got)
                print(f"zero-{stage} {side} run {rep}: {runs[side][-1]}", flush=True)
        bound_runs += runs.pop("bound", [])
        for side, got in runs.items():
            row[side] = _best(got)
        for side, key in (("deepspeed", ""), ("fsdp2", "_fsdp2")):
            if side in row and all(isinstance(row[s], dict) for s in ("megazoo", side)):
                mz, other = row["megazoo"], row[side]
                row["throughput_ratio" + key] = mz["tokens_per_s"] / other["tokens_per_s"]
                row["peak_rss_ratio" + key] = mz["peak_rss_mib"] / other["peak_rss_mib"]
        rows.append(row)
    bound = _best(bound_runs)
    if isinstance(bound, dict):  # every side's share of what the machine allows
        for row in rows:
            for side in ("megazoo",) + tuple(p[0] for p in PEERS):
                if isinstance(row.get(side), dict):
                    row[side]["share_of_bound"] = row[side]["tokens_per_s"] / bound["tokens_per_s"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    setup = {k: getattr(args, k) for k in ("world", "steps", "warmup", "hidden", "layers", "heads",
                                           "vocab", "seq", "micro_batch", "bucket_numel",
                                           "repeats", "dtype")}
    setup.update(cpus=os.cpu_count(), load_avg_before=load_before[0],
                 load_avg_after=os.getloadavg()[0])
    with open(args.out + ".json", "w") as f:
        json.dump(dict(setup=setup, rows=rows, bound=bound), f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(_markdown(setup, rows, bound))
    plot(rows, args.out + ".png", bound)
    print(_markdown(setup, rows, bound))


def _best(got: list):
    """Best of a side's runs (throughput is only ever lowered by other load on the host), with
    every run's tokens/s; the last failure if none ran; None if it did not run at all."""
    ok = [g for g in got if isinstance(g, dict)]
    if not ok:
        return got[-1] if got else None
    best = dict(max(ok, key=lambda g: g["tokens_per_s"]))
    best["tokens_per_s_all"] = [g["tokens_per_s"] for g in ok]
    return best


PEERS = (("deepspeed", "DeepSpeed", "", "tab:gray"), ("fsdp2", "FSDP2", "_fsdp2", "tab:olive"))


def plot(rows: list[dict], path: str, bound=None) -> None:
    """Tokens/s and peak RSS per rank, megazoo next to each peer measured, per ZeRO stage (and
    the bound, a line, where it was measured)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [(r, side, color, key) for r in rows for side, _, key, color in PEERS
            if "throughput_ratio" + key in r]
    if not bars:
        return
    x = range(len(bars))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, field, label in ((axes[0], "tokens_per_s", "tokens/s (all ranks)"),
                             (axes[1], "peak_rss_mib", "peak RSS per rank, MiB")):
        ax.bar([i for i in x], [r["megazoo"][field] for r, *_ in bars], 0.4, color="tab:blue",
               label="megazoo")
        ax.bar([i + 0.4 for i in x], [r[side][field] for r, side, *_ in bars], 0.4,
               color=[c for *_, c, _ in bars], label="peer")
        ratio = "throughput_ratio" if field == "tokens_per_s" else "peak_rss_ratio"
        for i, (r, side, _, key) in zip(x, bars):
            ax.text(i + 0.2, max(r["megazoo"][field], r[side][field]), f"{r[ratio + key]:.2f}x",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks([i + 0.2 for i in x], [f"ZeRO-{r['stage']}\nvs {side}" for r, side, *_ in bars],
                      fontsize=8)
        ax.set_ylabel(label)
    if isinstance(bound, dict):
        axes[0].axhline(bound["tokens_per_s"], color="tab:red", linestyle="--", linewidth=1,
                        label="bound (no communication)")
    axes[0].legend(fontsize=8)
    fig.suptitle("megazoo vs DeepSpeed / FSDP2, same model and batch (labels: megazoo / peer)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _markdown(setup: dict, rows: list[dict], bound=None) -> str:
    if isinstance(bound, dict):
        ceiling = (f"bound ({setup['world']} processes, each alone in its own world, no "
                   f"communication): {bound['tokens_per_s']:.0f} tok/s (runs: "
                   + ", ".join(f"{t:.0f}" for t in bound["tokens_per_s_all"]) + ")")
    else:
        ceiling = f"bound: {bound or 'not measured'}"
    lines = [f"setup: {json.dumps(setup)}", "", ceiling, "",
             "| stage | peer | megazoo tok/s | peer tok/s | ratio | megazoo / peer share of bound | "
             "megazoo peak RSS MiB (growth) | "
             "peer peak RSS MiB (growth) | RSS ratio | megazoo / peer share of GEMM peak | "
             "final loss mz / peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def share(side: dict) -> str:
        return f"{100 * side['share_of_bound']:.0f}%" if "share_of_bound" in side else "-"
    for r in rows:
        mz = r["megazoo"]
        peers = [p for p in PEERS if p[0] in r]
        if not peers and isinstance(mz, dict):  # megazoo alone (--no-deepspeed, no FSDP2 here)
            lines.append(
                f"| {r['stage']} | - | {mz['tokens_per_s']:.0f} | | | {share(mz)} / - | "
                f"{mz['peak_rss_mib']:.0f} ({mz['rss_growth_mib']:.0f}) | | | "
                f"{100 * mz['fraction_of_gemm_peak']:.0f}% / - | {mz['final_loss']:.4f} / - |")
        for side, name, key, _ in peers:
            other = r[side]
            if not (isinstance(mz, dict) and isinstance(other, dict)):
                lines.append(f"| {r['stage']} | {name} | {mz} | {other} | | | | | | | |")
                continue
            lines.append(
                f"| {r['stage']} | {name} | {mz['tokens_per_s']:.0f} | {other['tokens_per_s']:.0f} | "
                f"{r['throughput_ratio' + key]:.2f} | {share(mz)} / {share(other)} | "
                f"{mz['peak_rss_mib']:.0f} ({mz['rss_growth_mib']:.0f}) | "
                f"{other['peak_rss_mib']:.0f} ({other['rss_growth_mib']:.0f}) | "
                f"{r['peak_rss_ratio' + key]:.2f} | {100 * mz['fraction_of_gemm_peak']:.0f}% / "
                f"{100 * other['fraction_of_gemm_peak']:.0f}% | "
                f"{mz['final_loss']:.4f} / {other['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
