"""Muon against AdamW on real English prose: Jane Austen's six novels, GPT-2 tokenizer, a small
GPT and a small Llama, each optimizer at its best of a few learning rates, validation loss
curves side by side.

The corpus: Debian's `r-cran-janeaustenr` package (MIT; the novels themselves are public
domain: Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger Abbey,
Persuasion; ~730k words) stores them as an R lazy-load database, one character vector of lines
per novel. `austen_novels` reads that database without R (zlib chunks of R's XDR
serialization). Fetch the package without installing R:

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb austen
    nice -n 10 python bench/bench_muon_vs_adamw.py --austen austen

Every 20th passage (of ~40 lines) is held out for validation; the rest is tokenized with
tools/preprocess_data.py (GPT-2 BPE from tests/fixtures) into indexed files. Each run trains on
random windows of --seq tokens (the same windows, in the same order, for every run), warmup
then cosine decay, and evaluates the mean loss over fixed validation windows every
--eval-interval steps. Muon runs with the library's defaults (Moonlight's RMS-matched scale,
so AdamW's learning rates are the natural grid for both), Newton-Schulz in bf16. Results are
written after every run; --reuse keeps the runs --out holds with the same settings (the runs are
deterministic), so widening a grid trains only its new points.

Writes bench/results/muon_vs_adamw.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megazoo.data.indexed import IndexedDataset  # noqa: E402
from megazoo.models.config import TransformerConfig  # noqa: E402
from megazoo.models.language_model import TransformerLanguageModel  # noqa: E402
from megazoo.parallel.topology import ParallelTopology  # noqa: E402
from megazoo.parallel.zero import OptimizerConfig, build_optimizer  # noqa: E402
from megazoo.parallel.zero.muon import MuonSettings  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2")
DATABASE = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
PASSAGE_LINES, HOLD_OUT_EVERY = 40, 20


def _r_strings(blob: bytes) -> list[str]:
    """A serialized R character vector (XDR, format 2 or 3) -> its strings."""
    if blob[:2] != b"X\n":
        raise ValueError("not an XDR R serialization")
    pos = 2
    version = struct.unpack(">i", blob[pos:pos + 4])[0]
    pos += 12  # format version, writer's R version, minimal R version
    if version == 3:
        n = struct.unpack(">i", blob[pos:pos + 4])[0]
        pos += 4 + n  # the native encoding's name
    flags, length = struct.unpack(">ii", blob[pos:pos + 8])
    if flags & 0xFF != 16:  # STRSXP
        raise ValueError(f"R object of type {flags & 0xFF}, not a character vector")
    pos += 8
    out = []
    for _ in range(length):
        _, n = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        if n < 0:  # NA_character_
            out.append("")
            continue
        out.append(blob[pos:pos + n].decode("utf-8"))
        pos += n
    return out


def austen_novels(folder: str) -> list[list[str]]:
    """The novels' lines from an extracted r-cran-janeaustenr package."""
    data = open(os.path.join(folder, DATABASE), "rb").read()
    novels, pos = [], 0
    while pos < len(data):
        inflater = zlib.decompressobj()
        blob = inflater.decompress(data[pos + 4:])  # 4 bytes: the uncompressed length
        pos = len(data) - len(inflater.unused_data)
        novels.append(_r_strings(blob))
    return novels


def prepare(folder: str, work: str) -> tuple[str, str, dict]:
    """Train/validation JSONL of passages, tokenized by tools/preprocess_data.py: the prefixes."""
    counts = {"train": 0, "valid": 0}
    files = {k: open(os.path.join(work, f"{k}.jsonl"), "w") for k in counts}
    passage = 0
    for lines in austen_novels(folder):
        for i in range(0, len(lines), PASSAGE_LINES):
            text = "\n".join(lines[i:i + PASSAGE_LINES]).strip()
            if not text:
                continue
            split = "valid" if passage % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 else "train"
            files[split].write(json.dumps({"text": text}) + "\n")
            counts[split] += 1
            passage += 1
    for f in files.values():
        f.close()
    prefixes = []
    for split in ("train", "valid"):
        prefix = os.path.join(work, split)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", os.path.join(work, f"{split}.jsonl"), "--output-prefix", prefix,
                        "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", os.path.join(GPT2, "vocab.json"),
                        "--merge-file", os.path.join(GPT2, "merges.txt"), "--append-eod",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        prefixes.append(prefix + "_text_document")
    return prefixes[0], prefixes[1], counts


def tokens_of(prefix: str) -> np.ndarray:
    ds = IndexedDataset(prefix)
    return np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)


def model_config(family: str, args) -> TransformerConfig:
    common = dict(vocab_size=50257, hidden_size=args.hidden, num_layers=args.layers,
                  num_attention_heads=args.hidden // 32, max_position_embeddings=args.seq, seed=1)
    if family == "gpt":
        return TransformerConfig(ffn_hidden_size=4 * args.hidden, **common)
    return TransformerConfig(ffn_hidden_size=8 * args.hidden // 3 // 16 * 16,
                             num_query_groups=args.hidden // 64, normalization="rmsnorm",
                             activation="swiglu", position_embedding="rope", bias=False,
                             tie_word_embeddings=False, **common)


def lr_at(step: int, peak: float, args) -> float:
    if step < args.warmup:
        return peak * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))  # down to 10% of the peak


def windows(tokens: np.ndarray, count: int, seq: int, seed: int) -> torch.Tensor:
    starts = np.random.default_rng(seed).integers(0, len(tokens) - seq - 1, count)
    return torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]))


def run(family: str, optimizer: str, lr: float, train, valid, args) -> dict:
    torch.manual_seed(0)
    topo = ParallelTopology.single()
    model = TransformerLanguageModel(model_config(family, args), topo)
    opt = build_optimizer(model, topo, OptimizerConfig(
        optimizer=optimizer, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=1.0,
        precision=args.precision, muon=MuonSettings(ns_dtype="bf16")))
    curve, start = [], time.perf_counter()

    def evaluate(step: int):
        model.eval()
        with torch.no_grad():
            losses = [model(w[:, :-1], labels=w[:, 1:]).float().mean().item()
                      for w in valid.split(args.batch)]
        model.train()
        curve.append([step, sum(losses) / len(losses)])

    for step in range(args.steps):
        if step % args.eval_interval == 0:
            evaluate(step)
        opt.lr = lr_at(step, lr, args)
        w = train[step * args.batch:(step + 1) * args.batch]
        loss = model(w[:, :-1], labels=w[:, 1:]).float().mean()
        opt.backward(loss)
        opt.step(loss=loss.detach())
        opt.zero_grad()
    evaluate(args.steps)
    seconds = time.perf_counter() - start
    print(f"{family} {optimizer} lr {lr:g}: validation loss {curve[-1][1]:.4f} "
          f"({seconds:.0f} s)", flush=True)
    return {"family": family, "optimizer": optimizer, "lr": lr, "valid_loss": curve,
            "final_valid_loss": curve[-1][1], "seconds": round(seconds, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--austen", required=True, help="extracted r-cran-janeaustenr package folder")
    p.add_argument("--families", nargs="+", default=["gpt", "llama"])
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs --out already holds with the same settings")
    p.add_argument("--out", default=os.path.join(RESULTS, "muon_vs_adamw.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        train_prefix, valid_prefix, passages = prepare(args.austen, work)
        train_tokens, valid_tokens = tokens_of(train_prefix), tokens_of(valid_prefix)
    train = windows(train_tokens, args.steps * args.batch, args.seq, seed=1)
    valid = windows(valid_tokens, args.eval_windows, args.seq, seed=2)
    print(f"Jane Austen: {len(train_tokens)} training tokens, {len(valid_tokens)} validation "
          f"tokens ({passages['train']} / {passages['valid']} passages)", flush=True)
    params = {f: sum(p.numel() for p in TransformerLanguageModel(
        model_config(f, args), ParallelTopology.single()).parameters()) for f in args.families}
    done = previous_runs(args)
    runs = []
    for family in args.families:
        for optimizer in args.optimizers:
            for lr in (args.muon_lrs if optimizer == "muon" else args.adamw_lrs):
                again = done.get((family, optimizer, lr))
                runs.append(again or run(family, optimizer, lr, train, valid, args))
                write(args, runs, params, len(train_tokens), len(valid_tokens))  # as they finish


def previous_runs(args) -> dict:
    """--reuse: the runs of --out made with the same model, data and schedule settings (the runs
    are deterministic), so a widened learning-rate grid trains only its new points."""
    if not args.reuse or not os.path.exists(args.out):
        return {}
    old = json.load(open(args.out))
    grid = ("families", "optimizers", "adamw_lrs", "muon_lrs")
    mine = {k: v for k, v in settings_of(args).items() if k not in grid}
    if {k: v for k, v in old["settings"].items() if k not in grid} != mine:
        return {}
    return {(r["family"], r["optimizer"], r["lr"]): r for r in old["runs"]}


def settings_of(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("austen", "out", "reuse")}


def write(args, runs: list[dict], params: dict, train_tokens: int, valid_tokens: int) -> None:
    """The results so far: every run's curve and each family/optimizer's best learning rate."""
    best = {}
    for r in runs:
        key = f"{r['family']}/{r['optimizer']}"
        if key not in best or r["final_valid_loss"] < best[key]["final_valid_loss"]:
            best[key] = r
    summary = {key: {"lr": r["lr"], "final_valid_loss": round(r["final_valid_loss"], 4),
                     "valid_loss": r["valid_loss"]} for key, r in best.items()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"corpus": "Jane Austen's six novels (Debian r-cran-janeaustenr 1.0.0)",
                   "tokenizer": "GPT-2 BPE", "train_tokens": train_tokens,
                   "valid_tokens": valid_tokens, "parameters": params,
                   "settings": settings_of(args),
                   "tokens_seen_per_run": args.steps * args.batch * args.seq,
                   "best": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
