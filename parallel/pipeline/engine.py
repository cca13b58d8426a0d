"""Execute one rank's pipeline step list: forwards, backwards and batched p2p.

The schedule (see `schedules.py`) decides *what* runs when; this file only does it:

* each run of consecutive Comm steps becomes one batched exchange (`collectives.exchange`) on the
  pipeline group,
  waited on before the next compute step (the simulator proved the grouping deadlock-free);
* received tensors have a shape known in advance (`tensor_shape`, e.g. [s/tp, b, h] under
  sequence parallelism), so no shape messages are exchanged;
* after an activation is sent its storage is released, keeping only the autograd node, since
  the next stage has its own copy and the backward needs the graph, not the values;
* the last virtual stage's forward returns a scalar loss; its backward runs on loss / m, so the
  accumulated `.grad` is the gradient of the mean loss over the microbatches. Gradients are left
  in `.grad`; data-parallel and tied-embedding reductions happen afterwards, elsewhere.

Tensor parallelism needs nothing here: each TP rank talks to the same TP rank of the neighbour
stage (`topo.stage_rank`), and every TP rank of a stage runs the same list.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from megazoo.parallel import collectives as C
from megazoo.parallel.pipeline.schedules import (Backward, Comm, Forward, RecvActivation,
                                         RecvGrad, SendActivation, SendGrad, Step, comm_batches)
from megazoo.parallel.topology import ParallelTopology

logger = logging.getLogger(__name__)

# forward_fn(chunk_module, input_or_None, microbatch) -> hidden tensor, or the scalar loss on the
# last virtual stage. The input is None on the first virtual stage (read the microbatch instead).
ForwardFn = Callable[[nn.Module, "torch.Tensor | None", dict], torch.Tensor]


@dataclass
class PipelineStats:
    """What the engine measured on this rank during one `run_pipeline` call. Passing one turns
    on the saved-bytes count (a hook on every tensor autograd saves); training passes none."""

    peak_activations: int = 0  # most (microbatch, chunk) pairs alive between F and B
    peak_saved_bytes: int = 0  # most bytes autograd kept for them (parameters excluded)
    saved_bytes: dict = field(default_factory=dict)  # (mb, chunk) -> bytes saved by its forward


@dataclass
class Timeline:
    """Start and end of every forward and backward on this rank (time.perf_counter seconds)."""

    rank: int = 0
    events: list = field(default_factory=list)  # (kind "F"/"B", mb, chunk, start, end)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "events": [list(e) for e in self.events]}


def deallocate(t: torch.Tensor) -> None:
    """Drop a sent activation's values but keep its autograd node (Megatron's trick)."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from `output` with upstream `grad`, even when `output`'s values were released.

    torch.autograd.backward checks that grad and output shapes agree, which a deallocated output
    no longer satisfies, so call the autograd engine directly.
    """
    from torch.autograd import Variable  # noqa: PLC0415 - private entry point, kept local
    Variable._execution_engine.run_backward(  # noqa: SLF001
        (output,), (grad,), False, False, (), True, True)


def _storage_id(t: torch.Tensor) -> int:
    """Identity of the storage a tensor views (shared by all views of one allocation)."""
    return t.untyped_storage()._cdata  # noqa: SLF001 - the StorageImpl, stable across views


class SavedBytes:
    """Counts bytes autograd saves during a forward, skipping the parameters (shared, not
    activations), so the engine can report the activation memory it keeps alive.

    Storages are told apart by their identity, not their address: `meta` tensors (the dry run,
    tools/dry_run.py) and released ZeRO-3 buckets all have address 0. A tensor saved twice
    (RMSNorm's fp32 input, by both its square and its product) counts once."""

    def __init__(self, chunks: list[nn.Module]):
        self.param_storages = {_storage_id(p) for c in chunks for p in c.parameters()}
        self.total = 0
        self.seen: set = set()  # views saved so far in this forward (alive: autograd holds them)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = _storage_id(t)
        view = (sid, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if sid not in self.param_storages and view not in self.seen:
            self.seen.add(view)
            self.total += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


class _Runner:
    def __init__(self, chunks, microbatches, topo, tensor_shape, dtype, forward_fn, vpp,
                 stats, timeline, deallocate_outputs):
        self.chunks, self.microbatches, self.topo = chunks, microbatches, topo
        self.shape, self.dtype, self.forward_fn = tuple(tensor_shape), dtype, forward_fn
        self.pp, self.vpp = topo.pp, vpp
        self.stats = stats if stats is not None else PipelineStats()
        # Saved-tensor bytes are measured (through autograd hooks) only for a caller's `stats`.
        self.saved = SavedBytes(chunks) if stats is not None else None
        self.timeline, self.deallocate_outputs = timeline, deallocate_outputs
        self.inputs: dict = {}  # (mb, chunk) -> received activation (leaf, requires grad)
        self.outputs: dict = {}  # (mb, chunk) -> output (or loss) kept for the backward
        self.out_grads: dict = {}  # (mb, chunk) -> received gradient of the output
        self.in_grads: dict = {}  # (mb, chunk) -> gradient of the input, waiting to be sent
        self.losses: dict = {}  # mb -> detached loss (last stage only)
        self.forward_only = False  # set by run(): evaluation keeps no graph and no outputs
        self.live_bytes = 0

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.topo.pp_rank

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.pp * self.vpp - 1

    # ---- compute ------------------------------------------------------------------------
    def forward(self, op: Forward) -> None:
        key = (op.mb, op.chunk)
        inp = self.inputs.pop(key, None) if self.forward_only else self.inputs.get(key)
        with torch.set_grad_enabled(not self.forward_only):
            if self.saved is None:
                out = self.forward_fn(self.chunks[op.chunk], inp, self.microbatches[op.mb])
            else:
                out = self._measured_forward(key, inp, self.microbatches[op.mb], op.chunk)
        if self.is_last(op.chunk):
            if out.dim() != 0:
                raise ValueError(f"forward_fn must return a scalar loss on the last stage, got "
                                 f"shape {tuple(out.shape)}")
            self.losses[op.mb] = out.detach()
            if self.forward_only:
                return
            out = out / len(self.microbatches)
        elif tuple(out.shape) != self.shape:
            raise ValueError(f"stage {self.stage(op.chunk)} produced shape {tuple(out.shape)}, "
                             f"but the pipeline was told tensor_shape={self.shape}")
        self.outputs[key] = out
        self.stats.peak_activations = max(self.stats.peak_activations, len(self.outputs))

    def _measured_forward(self, key, inp, microbatch: dict, chunk: int) -> torch.Tensor:
        # A Python callback on every tensor autograd saves: only when the caller asked for stats.
        before, self.saved.seen = self.saved.total, set()
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack):
            out = self.forward_fn(self.chunks[chunk], inp, microbatch)
        self.stats.saved_bytes[key] = self.saved.total - before
        self.live_bytes += self.stats.saved_bytes[key]
        self.stats.peak_saved_bytes = max(self.stats.peak_saved_bytes, self.live_bytes)
        return out

    def backward(self, op: Backward) -> None:
        key = (op.mb, op.chunk)
        out = self.outputs.pop(key)
        if self.is_last(op.chunk):
            out.backward()
        else:
            backward_through(out, self.out_grads.pop(key))
        inp = self.inputs.pop(key, None)
        if inp is not None:
            self.in_grads[key] = inp.grad
        self.live_bytes -= self.stats.saved_bytes.get(key, 0)

    # ---- communication ------------------------------------------------------------------
    def communicate(self, batch: list[Comm]) -> None:
        sends, recvs, received = [], [], []
        for step in batch:
            key = (step.mb, step.chunk)
            peer = self.topo.stage_rank(step.peer)
            if isinstance(step, (RecvActivation, RecvGrad)):
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.topo.device)
                recvs.append((buf, peer))
                received.append((step, buf))
            elif isinstance(step, SendActivation):
                sends.append((self.outputs[key].detach(), peer))
            elif isinstance(step, SendGrad):
                sends.append((self.in_grads.pop(key), peer))
        C.exchange(sends, recvs, self.topo.pp_group).wait()
        for step, buf in received:
            key = (step.mb, step.chunk)
            if isinstance(step, RecvActivation):
                self.inputs[key] = buf if self.forward_only else buf.requires_grad_()
            else:
                self.out_grads[key] = buf
        for step in batch:
            if isinstance(step, SendActivation):
                if self.forward_only:
                    del self.outputs[(step.mb, step.chunk)]
                elif self.deallocate_outputs:
                    deallocate(self.outputs[(step.mb, step.chunk)])

    # ---- driver -------------------------------------------------------------------------
    def run(self, steps: list[Step]) -> list[torch.Tensor]:
        self.forward_only = not any(isinstance(s, Backward) for s in steps)
        for unit in comm_batches(steps):
            if isinstance(unit, list):
                self.communicate(unit)
                continue
            start = self._now()
            (self.forward if isinstance(unit, Forward) else self.backward)(unit)
            if self.timeline is not None:
                self.timeline.events.append(("F" if isinstance(unit, Forward) else "B", unit.mb,
                                             unit.chunk, start, self._now()))
        if self.outputs or self.in_grads or self.out_grads:
            raise RuntimeError("pipeline schedule left work behind: "
                               f"{list(self.outputs)} {list(self.in_grads)} {list(self.out_grads)}")
        return [self.losses[mb] for mb in sorted(self.losses)]

    def _now(self) -> float:
        # Device work is asynchronous; only a synchronised clock measures it.
        if self.timeline is not None and self.topo.device.type != "cpu":
            torch.get_device_module(self.topo.device).synchronize(self.topo.device)
        return time.perf_counter()


def run_pipeline(steps: list[Step], chunks: list[nn.Module], microbatches: list[dict],
                 topo: ParallelTopology, tensor_shape, dtype: torch.dtype, forward_fn: ForwardFn,
                 *, stats: PipelineStats | None = None, timeline: Timeline | None = None,
                 deallocate_outputs: bool = True) -> list[torch.Tensor]:
    """Run this rank's `steps` over its model `chunks` (one per virtual stage, in chunk order).

    Returns the per-microbatch losses (detached, in microbatch order) on the rank holding the
    last virtual stage, and [] elsewhere. Parameter gradients are accumulated into `.grad` as
    d(mean loss over microbatches).
    """
    if any(isinstance(s, Comm) for s in steps) and topo.pp == 1:
        raise ValueError("a schedule with p2p steps needs a topology with pp > 1")
    if len(chunks) != topo.vpp:
        raise ValueError(f"got {len(chunks)} model chunks for {topo.vpp} virtual pipeline stages "
                         f"per rank; build one chunk per (rank, chunk) of partition()")
    used = {s.mb for s in steps}
    if used and max(used) >= len(microbatches):
        raise ValueError(f"the schedule runs {max(used) + 1} microbatches, {len(microbatches)} "
                         f"were given")
    runner = _Runner(chunks, microbatches, topo, tensor_shape, dtype, forward_fn, len(chunks),
                     stats, timeline, deallocate_outputs)
    losses = runner.run(steps)
    logger.debug("pipeline rank %d: peak %d activations, %d saved bytes", topo.pp_rank,
                 runner.stats.peak_activations, runner.stats.peak_saved_bytes)
    return losses
