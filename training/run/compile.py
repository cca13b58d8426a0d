"""`--compile`: each transformer layer compiled on its own with torch.compile, the rest (embedding,
loss, the pipeline and ZeRO machinery, the collectives between layers) eager, as torchtitan does.
Compiling per layer keeps compile time to one graph per distinct layer kind (layers of one kind
share it) and leaves every layout's communication outside the graphs, so the same run works
under every layout, on the CPU (inductor's C++ backend) and on CUDA (Triton) alike.

Graph breaks inside a layer (a call torch.compile cannot trace) cost a return to Python per
break: they are counted after the first step and reported once, with their reasons.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

def compile_layers(chunks, backend: str) -> int:
    """Compile the forward of every transformer layer of `chunks` in place (names and state dicts
    unchanged; the module's hooks, such as ZeRO-3's gathers, stay eager around it); returns how
    many."""
    layers = [layer for chunk in chunks for layer in chunk.transformer_layers()]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)


def graph_breaks() -> dict[str, int]:
    """Graph breaks so far in this process: reason -> count."""
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def report_graph_breaks(journal, rank: int, layers: int, backend: str) -> int:
    """Log (rank 0) and journal the graph breaks of the first compiled step; returns their number."""
    breaks = graph_breaks()
    total = sum(breaks.values())
    if rank == 0:
        detail = "; ".join(f"{n} x {reason}" for reason, n in sorted(breaks.items())[:5])
        (logger.warning if total else logger.info)(
            "--compile: %d layers compiled (%s), %d graph break(s) inside them%s", layers,
            backend, total, f": {detail}" if total else "")
        journal.event("compile", layers=layers, backend=backend, graph_breaks=total)
    return total
