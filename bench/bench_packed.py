"""A packed training step against an unpacked causal one of the same length (CPU, one process).

One sample of `--seq` tokens (2048) of a small Llama (GQA, RoPE, SwiGLU) holding `--documents`
documents (16; uneven lengths drawn once) with --reset-attention-mask --reset-position-ids
semantics, against the same tokens as one causal sequence: forward + backward of the per-token
loss, `--steps` timed steps after one warm-up, median. The goal: the packed step costs no more
than 1.2x the causal one (attention runs per document: less work than the causal triangle).

    python bench/bench_packed.py [--seq 2048] [--documents 16] [--steps 5] [--dtype fp32]

Writes bench/results/packed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from data.packing import positions_in_documents  # noqa: E402
from models.config import TransformerConfig  # noqa: E402
from models.language_model import TransformerLanguageModel  # noqa: E402
from parallel.context_parallel import Documents  # noqa: E402
from parallel.topology import ParallelTopology  # noqa: E402

MODEL = dict(vocab_size=4096, hidden_size=256, num_layers=2, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=688, position_embedding="rope", normalization="rmsnorm",
             activation="swiglu", bias=False, tie_word_embeddings=False,
             make_vocab_size_divisible_by=8, seed=1)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def document_ids(seq: int, documents: int, seed: int = 0) -> torch.Tensor:
    """[1, seq] ids of `documents` documents of uneven lengths (each at least 16 tokens)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq // 16 - 1, generator=g)[:documents - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts * 16, torch.tensor([seq])]))
    return torch.repeat_interleave(torch.arange(documents), lengths)[None]


def time_steps(model, ids, labels, documents, steps: int) -> float:
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        model(ids, labels=labels, documents=documents).float().mean().backward()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = p.parse_args()
    cfg = TransformerConfig(**MODEL, max_position_embeddings=args.seq, params_dtype=DTYPES[args.dtype])
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    docs = document_ids(args.seq, args.documents)
    packed = Documents(ids=docs, positions=positions_in_documents(docs))
    causal = time_steps(model, ids, labels, None, args.steps)
    packed_s = time_steps(model, ids, labels, packed, args.steps)
    result = {"seq": args.seq, "documents": args.documents, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "causal_s": causal, "packed_s": packed_s,
              "packed_over_causal": packed_s / causal}
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "packed.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
