"""`--compile`: each transformer layer compiled on its own with torch.compile, the rest (embedding,
loss, the pipeline and ZeRO machinery, the collectives between layers) eager, as torchtitan does.
Compiling per layer keeps compile time to one graph per distinct layer kind (layers of one kind
share it) and leaves the communication between layers outside the graphs, so the same run works
under every layout, on the CPU (inductor's C++ backend) and on CUDA (Triton) alike.

Inside a layer, tensor and sequence parallelism's collectives are traced as functional
collectives (parallel/collectives.py), so a dense layer compiles whole under tp, tp + SP, pp and
ZeRO-3. A mixture-of-experts layer's routing (token counts, capacity, the uneven all-to-all
exchange of expert parallelism, the grouped expert matmul) has shapes that depend on the data:
traced, it broke the graph at every such point (20 breaks in a 2-layer ep2 model, each a return to
Python and a recompile when the counts change); here `MoELayer.routed` runs eager as one unit,
one break per MoE layer, and the router-free rest of the layer (norms, attention, shared experts)
is compiled.

Graph breaks (a call torch.compile cannot trace) are counted per layer while the first step
traces the layers (a layer that reuses another layer's graph traces nothing, so its breaks show
once, under the first layer of its kind) and reported once, with their reasons.
"""
from __future__ import annotations

import logging

import torch

from megazoo.models.moe import moe_layers

logger = logging.getLogger(__name__)


def graph_breaks() -> dict[str, int]:
    """Graph breaks so far in this process: reason (its first line) -> count."""
    from torch._dynamo.utils import counters
    out: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = reason.split("\n")[0]
        out[key] = out.get(key, 0) + n
    return out


class CompiledLayer:
    """A layer's compiled forward that counts the graph breaks traced during its calls."""

    def __init__(self, forward, backend: str):
        self.forward = torch.compile(forward, backend=backend)
        self.breaks, self.counting = 0, True

    def __call__(self, *args, **kwargs):
        if not self.counting:
            return self.forward(*args, **kwargs)
        before = sum(graph_breaks().values())
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.breaks += sum(graph_breaks().values()) - before


class CompiledLayers:
    """The compiled layers of a run, by name (`chunk C layer I`)."""

    def __init__(self, chunks, backend: str):
        self.backend, self.layers = backend, {}
        for c, chunk in enumerate(chunks):
            for i, layer in enumerate(chunk.transformer_layers()):
                for moe in moe_layers(layer):  # data-dependent shapes: eager as one unit
                    moe.routed = torch.compiler.disable(moe.routed)
                layer.forward = self.layers[f"chunk {c} layer {i}"] = CompiledLayer(layer.forward, backend)

    def __len__(self) -> int:
        return len(self.layers)

    def breaks(self) -> dict[str, int]:
        """Graph breaks traced per layer so far."""
        return {name: layer.breaks for name, layer in self.layers.items()}

    def stop_counting(self) -> None:
        """The layers run without looking at the counters from now on."""
        for layer in self.layers.values():
            layer.counting = False


def compile_layers(chunks, backend: str) -> CompiledLayers:
    """Compile the forward of every transformer layer of `chunks` in place (names and state dicts
    unchanged; the module's hooks, such as ZeRO-3's gathers, stay eager around it)."""
    return CompiledLayers(chunks, backend)


def report_graph_breaks(journal, rank: int, compiled: CompiledLayers) -> int:
    """Log (rank 0) and journal the graph breaks of the first compiled step, per layer and by
    reason (later recompiles are not counted); returns their number."""
    per_layer = compiled.breaks()
    total = sum(per_layer.values())
    if rank == 0:
        reasons = "; ".join(f"{n} x {reason}" for reason, n in sorted(graph_breaks().items())[:5])
        layers = ", ".join(f"{name}: {n}" for name, n in per_layer.items())
        (logger.warning if total else logger.info)(
            "--compile: %d layers compiled (%s), %d graph break(s) inside them (%s)%s",
            len(compiled), compiled.backend, total, layers, f": {reasons}" if total else "")
        journal.event("compile", layers=len(compiled), backend=compiled.backend,
                      graph_breaks=total, graph_breaks_per_layer=per_layer)
    compiled.stop_counting()
    return total
