"""The demo: train a small GPT with tp=2 x pp=2 (4 CPU processes) on the Python standard library.

    python tools/demo.py                 # GPT; --arch bloom for BLOOM; --gpt2-tokenizer for GPT-2's
    python tools/demo.py --arch moe      # a mixture of experts (moe-tiny: 8 experts, top-2) with
                                         # experts split over 2 ranks: tp=2 x ep=2, ZeRO-1

1. corpus: the standard library's top-level *.py files (about 5 MB of real code and docstrings);
2. tokenizer: a 4,096-token byte-level BPE trained on that corpus (tools/train_tokenizer.py), or
   the GPT-2 tokenizer shipped in tests/fixtures/gpt2 (MIT) with --gpt2-tokenizer;
3. preprocessing into Megatron's .bin/.idx (tools/preprocess_data.py);
4. training under torchrun (train_gpt.py, train_bloom.py or train_moe.py), its output streamed as it runs,
   validation every 100 iterations, a checkpoint at the end, in one run folder per architecture
   (runs/demo-gpt, runs/demo-bloom, runs/demo-moe: checkpoints, journal, metrics.jsonl, report.png); then the
   validation loss is set against the corpus' unigram entropy.

torchrun's port is MASTER_PORT when set, else a free one (torchrun --standalone).
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import subprocess
import sys
import sysconfig

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GPT2 = os.path.join(REPO, "tests", "fixtures", "gpt2")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, check=True, **kw)


def stream(cmd: list[str], env: dict) -> list[str]:
    """Run cmd, printing its output as it comes (Python warnings left out); returns the lines.
    A failure ends the demo with the exit code after the output that explains it."""
    print("$", " ".join(cmd), flush=True)
    lines = []
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            lines.append(line)
            if "Warning" not in line and "warn(" not in line:
                print(line, end="", flush=True)
    if proc.returncode != 0:
        sys.exit(f"demo: training failed (exit code {proc.returncode}); the output above says why")
    return lines


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats) of the token unigram distribution: the loss of a model without context."""
    from megazoo.data.indexed import IndexedDataset
    tokens = np.concatenate(list(IndexedDataset(prefix)))
    counts = np.bincount(tokens.astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["gpt", "bloom", "moe"], default="gpt")
    ap.add_argument("--gpt2-tokenizer", action="store_true", help="GPT-2's 50,257-token BPE (slower)")
    ap.add_argument("--train-iters", type=int, default=400)
    ap.add_argument("--workdir", default=os.path.join(REPO, "demo_data"))
    ap.add_argument("--save", help="run folder (default: runs/demo-ARCH)")
    args = ap.parse_args()
    args.save = args.save or os.path.join(REPO, "runs", f"demo-{args.arch}")
    os.makedirs(args.workdir, exist_ok=True)
    files = sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py")))
    print(f"corpus: {len(files)} standard-library files, "
          f"{sum(os.path.getsize(f) for f in files) / 1e6:.1f} MB", flush=True)
    stdlib_glob = os.path.join(sysconfig.get_path("stdlib"), "*.py")

    if args.gpt2_tokenizer:
        vocab, merges = os.path.join(GPT2, "vocab.json"), os.path.join(GPT2, "merges.txt")
    else:
        tok_dir = os.path.join(args.workdir, "tokenizer")
        vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
        if not os.path.exists(merges):
            run([sys.executable, "tools/train_tokenizer.py", "--input", stdlib_glob, "--type", "bpe",
                 "--vocab-size", "4096", "--output", tok_dir])
    prefix = os.path.join(args.workdir, "stdlib_gpt2" if args.gpt2_tokenizer else "stdlib")
    if not os.path.exists(prefix + "_text_document.idx"):
        run([sys.executable, "tools/preprocess_data.py", "--input", stdlib_glob, "--output-prefix", prefix,
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
             "--append-eod", "--workers", "2", "--no-progress"])
    data = prefix + "_text_document"

    script = dict(gpt="train_gpt.py", bloom="train_bloom.py", moe="train_moe.py")[args.arch]
    layout = ["--pipeline-model-parallel-size", "2"] if args.arch != "moe" else \
        ["--expert-model-parallel-size", "2", "--zero-stage", "1"]
    # MASTER_PORT when set, else torchrun's --standalone rendezvous on a free port
    port = ["--master_port", os.environ["MASTER_PORT"]] if os.environ.get("MASTER_PORT") else ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", *port, script,
           "--tensor-model-parallel-size", "2", *layout,
           "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
           "--seq-length", "128", "--max-position-embeddings", "128",
           "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(args.train_iters),
           "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "40", "--lr-decay-style", "cosine",
           "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0.0",
           "--attention-dropout", "0.0", "--data-path", data, "--split", "949,50,1",
           "--vocab-file", vocab, "--merge-file", merges, "--log-interval", "20",
           "--eval-interval", str(min(100, args.train_iters)), "--eval-iters", "10", "--save", args.save,
           "--log-throughput"]
    log = "".join(stream(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    valid = [float(v) for v in re.findall(r"valid iter \d+(?:/\d+)? \| loss ([0-9.]+)", log)]
    entropy = unigram_entropy(data)
    print(f"\nunigram entropy of the corpus: {entropy:.3f} nats/token; validation loss: "
          f"{valid[0]:.3f} at the first evaluation, {valid[-1]:.3f} at the end "
          f"({math.exp(valid[-1]):.1f} perplexity)")
    print(f"checkpoint: {args.save} (latest: {open(os.path.join(args.save, 'latest')).read().strip()}); "
          f"report: {os.path.join(args.save, 'report.png')}")
    print("resume or extend: rerun the torchrun command above with --load", args.save,
          "and a larger --train-iters")


if __name__ == "__main__":
    main()
