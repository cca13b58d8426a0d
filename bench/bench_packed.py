"""A packed training step against an unpacked causal one of the same length (CPU, one process).

One sample of `--seq` tokens (2048) of a small Llama (GQA, RoPE, SwiGLU) holding `--documents`
documents (16; uneven lengths drawn once) with --reset-attention-mask --reset-position-ids
semantics, against the same tokens as one causal sequence: forward + backward of the per-token
loss, in fp32 and in bf16. The goal: the packed step costs no more than 1.2x the causal one
(attention runs per document: less work than the causal triangle, the rest is the same).

On a shared machine load comes and goes, so the two cases are interleaved: each repeat times one
causal and one packed step back to back (alternating which goes first), after one untimed step of
each. Reported per dtype, in wall time and in the process's CPU time (what the step costs in
work, which other jobs' load moves far less, above all with `--threads 1`): the median step of
each case, the ratio of those medians and the median of the per-repeat ratios (the paired
figure, which a load change between repeats does not move), with the spread of the per-repeat
ratios. The process lowers its own priority (`--nice`) so that it takes only idle CPU from other
jobs rather than competing with them.

    python -m bench.bench_packed [--seq 2048] [--documents 16] [--repeats 7] [--dtypes fp32 bf16]
                                 [--threads N] [--out bench/results/packed.json]

Writes bench/results/packed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from megazoo.data.packing import positions_in_documents
from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.context_split import Documents
from megazoo.parallel.topology import ParallelTopology

MODEL = dict(vocab_size=4096, hidden_size=256, num_layers=2, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=688, position_embedding="rope", normalization="rmsnorm",
             activation="swiglu", bias=False, tie_word_embeddings=False,
             make_vocab_size_divisible_by=8, seed=1)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
GOAL = 1.2  # packed step / causal step, at most


def document_ids(seq: int, documents: int, seed: int = 0) -> torch.Tensor:
    """[1, seq] ids of `documents` documents of uneven lengths (each at least 16 tokens)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq // 16 - 1, generator=g)[:documents - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts * 16, torch.tensor([seq])]))
    return torch.repeat_interleave(torch.arange(documents), lengths)[None]


def one_step(model, ids, labels, documents) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + backward."""
    start, cpu = time.perf_counter(), time.process_time()
    model(ids, labels=labels, documents=documents).float().mean().backward()
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return elapsed


def measure(dtype: str, seq: int, documents: int, repeats: int) -> dict:
    cfg = TransformerConfig(**MODEL, max_position_embeddings=seq, params_dtype=DTYPES[dtype])
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    docs = document_ids(seq, documents)
    cases = {"causal": None, "packed": Documents(ids=docs, positions=positions_in_documents(docs))}
    for d in cases.values():  # warm-up: allocator, kernels, the attention path's first log
        one_step(model, ids, labels, d)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for r in range(repeats):
        for name in (("causal", "packed") if r % 2 == 0 else ("packed", "causal")):
            times[name].append(one_step(model, ids, labels, cases[name]))
    lengths = torch.unique_consecutive(docs[0], return_counts=True)[1].double()
    # attention score work of the documents' triangles against the whole sequence's triangle
    out = {"attention_work_ratio": float((lengths * (lengths + 1)).sum() / (seq * (seq + 1)))}
    for i, clock in enumerate(("wall", "cpu")):
        causal = [t[i] for t in times["causal"]]
        packed = [t[i] for t in times["packed"]]
        ratios = [p / c for p, c in zip(packed, causal)]
        out[clock] = {"causal_s": statistics.median(causal), "packed_s": statistics.median(packed),
                      "packed_over_causal": statistics.median(packed) / statistics.median(causal),
                      "paired_ratio_median": statistics.median(ratios),
                      "paired_ratio_range": [min(ratios), max(ratios)],
                      "causal_steps_s": causal, "packed_steps_s": packed}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--nice", type=int, default=10, help="priority increment (0: none)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "packed.json"))
    args = p.parse_args()
    if args.nice:
        os.nice(args.nice)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"seq": args.seq, "documents": args.documents, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "goal_packed_over_causal_at_most": GOAL, "dtypes": {}}
    for dtype in args.dtypes:
        result["dtypes"][dtype] = r = measure(dtype, args.seq, args.documents, args.repeats)
        for clock in ("wall", "cpu"):
            c = r[clock]
            print(f"{dtype} {clock}: causal {c['causal_s']:.3f} s, packed {c['packed_s']:.3f} s: "
                  f"{c['packed_over_causal']:.2f}x (paired median {c['paired_ratio_median']:.2f}x, "
                  f"range {c['paired_ratio_range'][0]:.2f}-{c['paired_ratio_range'][1]:.2f}x; "
                  f"attention work {r['attention_work_ratio']:.3f}x)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
