"""Context parallelism on CPU: per-rank memory and step time for C = 1, 2, 4 beside the planner's
prediction, the longest sequence a memory budget allows for each C, and a long training run.

1. `--memory` (default part): one sample of `--seq` tokens (8192) of a small Llama (GQA, RoPE)
   split over C ranks (a world of C gloo processes, ring attention, ZeRO-0, fp32), 1 warm-up + 2
   timed steps. Per rank: model-state bytes, the activation bytes autograd kept at the peak (the
   pipeline engine's counter), peak RSS; median step time (wall and CPU per rank). The planner
   (training/planning/planner.py, cp modelled) predicts states and activations for the same layout.
2. The longest sequence whose planned per-rank memory fits a budget, for each C: the bench's
   model in 1 GiB, and Llama-3-8B at tp8 with full recompute in 80 GB x 0.9.
3. `--train`: the real trainer (`torchrun --nproc_per_node 4 train_llama.py`) at sequence 16384
   with --context-parallel-size 4 on a small real corpus (Python's standard library, a 4,096-token
   BPE trained on it); prints the loss per step and the wall time. (--mock-data's repeating
   patterns need induction heads, which a 2-layer model does not form in tens of steps.)

Every rank runs one thread; worlds of 2 and 4 on 2 shared cores are oversubscribed, so wall time
measures contention as much as the model; the CPU seconds per rank are the comparable figure.

    python -m bench.bench_cp                 # parts 1 and 2 (~3 min on 2 shared cores)
    python -m bench.bench_cp --train         # part 3 as well (~5 min more)

Writes bench/results/cp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megazoo.models.config import TransformerConfig
from megazoo.models.presets import preset
from tests.distributed import run_distributed
from megazoo.training.planning.planner import Layout, memory_per_gpu

RESULTS = os.path.join(ROOT, "bench", "results")
MODEL = dict(vocab_size=512, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=256, position_embedding="rope", normalization="rmsnorm",
             activation="swiglu", bias=False, tie_word_embeddings=False,
             make_vocab_size_divisible_by=8, seed=1)
TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "3e-3",
               "--lr-warmup-iters", "3", "--lr-decay-style", "constant", "--log-interval", "1",
               "--eval-interval", "100000", "--eval-iters", "0"]


def _config(seq: int) -> TransformerConfig:
    return TransformerConfig(**MODEL, max_position_embeddings=seq)


def _layout(cp: int, seq: int, **kw) -> Layout:
    base = dict(cp=cp, seq_length=seq, micro_batch_size=1, global_batch_size=1,
                params_dtype="float32", flash_attention=True)
    return Layout.of(**{**base, **kw})


def _worker(rank, cp, seq, steps):
    import torch
    from megazoo.models.language_model import TransformerLanguageModel
    from megazoo.parallel.context_split import split_sequence
    from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
    from megazoo.parallel.pipeline.schedules import build_schedule
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.run.step import activation_shape, make_forward_fn

    cfg = _config(seq)
    topo = ParallelTopology.from_config(ParallelConfig(cp=cp))
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=0, lr=1e-4))
    g = torch.Generator().manual_seed(5)
    stats, wall, cpu = PipelineStats(), [], []
    for step in range(steps + 1):  # step 0 warms up
        t = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
        mb = {k: split_sequence(x, 1, cp, topo.cp_rank) for k, x in (("tokens", t[:, :-1]),
                                                                     ("labels", t[:, 1:]))}
        if cp > 1:
            torch.distributed.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        with opt.no_sync():
            run_pipeline(build_schedule("no_pipelining", 1, 0, 1), [model], [mb], topo,
                         activation_shape(topo, seq, 1, cfg.hidden_size), cfg.dtype,
                         make_forward_fn(), stats=stats)
        opt.grad_sync.launch_remaining()
        opt.step()
        opt.zero_grad()
        if cp > 1:
            torch.distributed.barrier()
        if step:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    return dict(states=opt.memory_report()["model_states"], activations=stats.peak_saved_bytes,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, wall=wall, cpu=cpu)


def measure(seq: int, steps: int) -> list[dict]:
    rows = []
    for cp in (1, 2, 4):
        ranks = run_distributed(_worker, cp, cp, seq, steps, timeout=1200)
        pred = memory_per_gpu(_config(seq), _layout(cp, seq))
        rows.append(dict(cp=cp, seq=seq,
                         states=max(r["states"] for r in ranks),
                         activations=max(r["activations"] for r in ranks),
                         rss=max(r["rss"] for r in ranks),
                         wall_s=statistics.median(w for r in ranks for w in r["wall"]),
                         cpu_s=statistics.median(c for r in ranks for c in r["cpu"]),
                         pred_states=pred.model_states, pred_activations=pred.activations))
    return rows


def longest_sequence(cfg, budget: float, step: int, make_layout) -> int:
    """Largest multiple of `step` whose planned memory fits `budget` (bytes)."""
    lo, hi = 0, step
    while memory_per_gpu(cfg.replace(max_position_embeddings=hi), make_layout(hi)).total <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        fits = memory_per_gpu(cfg.replace(max_position_embeddings=mid), make_layout(mid)).total
        lo, hi = (mid, hi) if fits <= budget else (lo, mid)
    return lo


def budgets() -> list[dict]:
    out = []
    small, llama = _config(1024), preset("llama3-8b")
    for cp in (1, 2, 4, 8):
        out.append(dict(model="bench model, fp32, 1 GiB", cp=cp, longest=longest_sequence(
            small, 2 ** 30, 2 * cp, lambda s, cp=cp: _layout(cp, s))))
        out.append(dict(model="llama3-8b, bf16, tp8, full recompute, ZeRO-1, 72 GB", cp=cp,
                        longest=longest_sequence(llama, 80e9 * 0.9, 2 * cp * 8, lambda s, cp=cp: Layout.of(
                            tp=8, cp=cp, sequence_parallel=True, recompute_granularity="full",
                            zero_stage=1, seq_length=s, flash_attention=True))))
    return out


def corpus(workdir: str) -> list[str]:
    """Data flags for a small real corpus: Python's standard library modules a-m (1.8 MB),
    a 4,096-token BPE trained on them, Megatron .bin/.idx (as tools/demo.py builds, smaller)."""
    import glob
    import sysconfig
    files = sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "[a-m]*.py")))
    tok, prefix = os.path.join(workdir, "tokenizer"), os.path.join(workdir, "stdlib_am")
    if not os.path.exists(os.path.join(tok, "merges.txt")):
        subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", *files, "--type",
                        "bpe", "--vocab-size", "4096", "--output", tok], cwd=ROOT, check=True)
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                 os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt")]
    if not os.path.exists(prefix + "_text_document.idx"):
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", *files,
                        "--output-prefix", prefix, *tok_flags, "--append-eod", "--no-progress"],
                       cwd=ROOT, check=True)
    return ["--data-path", prefix + "_text_document", "--split", "100,0,0", *tok_flags]


def train(seq: int, iters: int, workdir: str) -> dict:
    cmd = ["torchrun", "--nproc_per_node", "4", "--master_port", "29733",
           os.path.join(ROOT, "train_llama.py"), *TRAIN_FLAGS, *corpus(workdir),
           "--seq-length", str(seq), "--max-position-embeddings", str(seq),
           "--context-parallel-size", "4", "--train-iters", str(iters)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    losses = [float(x) for x in re.findall(r"train iter \d+(?:/\d+)? .*?\| loss ([0-9.]+)", done.stderr + done.stdout)]
    if done.returncode != 0 or len(losses) != iters:
        raise RuntimeError(f"training run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(seq=seq, cp=4, iters=iters, losses=losses, wall_s=wall,
                falls=sum(losses[-3:]) / 3 < sum(losses[:3]) / 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--train", action="store_true", help="also the 16384-token cp4 training run")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--workdir", default="/tmp/megazoo_bench_cp", help="corpus and tokenizer")
    a = p.parse_args()
    result = {"memory": measure(a.seq, a.steps), "budgets": budgets()}
    mib = 2 ** 20
    print(f"seq {a.seq}, one sample, {MODEL['num_layers']} layers h{MODEL['hidden_size']} (per rank; MiB)")
    print(f"{'C':>2} {'states':>8} {'pred':>8} {'activ.':>8} {'pred':>8} {'RSS':>8} {'wall s':>7} {'cpu s':>7}")
    for r in result["memory"]:
        print(f"{r['cp']:>2} {r['states'] / mib:8.2f} {r['pred_states'] / mib:8.2f} "
              f"{r['activations'] / mib:8.1f} {r['pred_activations'] / mib:8.1f} {r['rss'] / mib:8.0f} "
              f"{r['wall_s']:7.2f} {r['cpu_s']:7.2f}")
    print("longest sequence that fits (planner):")
    for r in result["budgets"]:
        print(f"  {r['model']}: cp{r['cp']} {r['longest']}")
    if a.train:
        result["train"] = train(16384, a.train_iters, a.workdir)
        t = result["train"]
        print(f"training at seq 16384, cp4: losses {[round(x, 3) for x in t['losses']]}, "
              f"{t['wall_s']:.0f} s, loss falls: {t['falls']}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "cp.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
