"""ZeRO-3: parameters sharded over DP, gathered one layer at a time just before use.

A *unit* is one layer (each child of an `nn.ModuleList` / `nn.ModuleDict` in the model) or the
root (everything else: embeddings, final norm, head). Outside its use a unit's parameters are
released (their flat buffer's storage has size 0); hooks bring them back:

    forward pre-hook     gather this unit (waiting on its prefetch), prefetch the next layer
    forward hook         release the layer; hook its outputs so backward gathers it again
    output-grad hook     gather this layer before its backward runs, prefetch the previous one
    buckets reduced      (all of the unit's gradients are in) release it again

The root and the last layer stay gathered from their forward until their gradients are in, since
they run last in forward and first in backward. With activation checkpointing the recompute runs
inside backward, after the output-grad hook; the forward hook then leaves the layer gathered.
(With reentrant checkpointing the recompute comes first and releases the layer; the output-grad
hook then gathers it again before its backward: one extra all-gather, same values, views stay
valid.)
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .. import collectives as C
from .flat_buffer import FlatBuffer

logger = logging.getLogger(__name__)


def split_layers(root: nn.Module) -> list[nn.Module]:
    """The layers under `root`: children of its ModuleLists/ModuleDicts (outermost first, module order)."""
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and id(module) not in inside:
            for child in (module.values() if isinstance(module, nn.ModuleDict) else module):
                if any(True for _ in child.parameters()):
                    layers.append(child)
                for m in child.modules():
                    inside.add(id(m))
    return layers


class Unit:
    def __init__(self, name: str, module: nn.Module, root: int, layer: int | None):
        self.name, self.module = name, module
        self.root, self.layer = root, layer  # layer None: the root unit itself
        self.is_root = layer is None
        self.buffers: list[FlatBuffer] = []
        self.pending: list[C.Pending] = []
        self.in_backward = False
        self.reduced: set[int] = set()

    def gather(self, async_op: bool) -> None:
        self.pending += [b.gather(async_op) for b in self.buffers if not b.gathered]

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending.clear()

    def ensure_gathered(self) -> None:
        self.gather(async_op=False)  # whatever no prefetch covered is gathered now
        self.wait()

    def release(self) -> None:
        self.wait()  # never free storage an in-flight all-gather is writing into
        for b in self.buffers:
            b.release()

    def gathered_bytes(self) -> int:
        return sum(b.params.untyped_storage().nbytes() for b in self.buffers)


class Zero3Hooks:
    """Installs and runs the gather / release hooks for the units of one or more roots."""

    def __init__(self, units: list[Unit], prefetch: bool = True):
        self.units, self.prefetch = units, prefetch
        self._unit_of_buffer = {id(b): u for u in units for b in u.buffers}
        self._handles = []
        self.peak_gathered_bytes = 0

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        """The layer used next: forward goes root, 0, 1, ...; backward ..., 1, 0 after the root."""
        layers = [u for u in self.units if u.root == unit.root and not u.is_root]
        if not layers:
            return None
        if unit.is_root:
            return layers[0] if step > 0 else layers[-1]
        i = unit.layer + step
        return layers[i] if 0 <= i < len(layers) else None

    def _note_peak(self) -> None:
        now = sum(u.gathered_bytes() for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    def _use(self, unit: Unit, direction: int) -> None:
        unit.ensure_gathered()
        nxt = self._neighbour(unit, direction) if self.prefetch else None
        if nxt is not None:
            nxt.gather(async_op=True)
        self._note_peak()

    # ---- hooks -------------------------------------------------------------------------------
    def install(self) -> None:
        for u in self.units:
            self._handles.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._use(u, +1)))
            self._handles.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._after_forward(u, out)))

    def _after_forward(self, unit: Unit, out) -> None:
        needs_grad = False
        for t in _tensors(out):
            if t.requires_grad:
                needs_grad = True
                t.register_hook(lambda g, u=unit: self._before_backward(u))
        if unit.in_backward:
            return  # a recompute inside backward: the layer's backward comes next
        if needs_grad and (unit.is_root or self._neighbour(unit, +1) is None):
            # The head's backward runs first, then the last layer's: keep both gathered until
            # their gradients are in (the last layer is gathered next to the root at the end
            # of forward anyway, so this saves an all-gather and adds nothing to the peak).
            return
        unit.release()

    def _before_backward(self, unit: Unit) -> None:
        unit.in_backward = True
        self._use(unit, -1)

    def on_bucket_launched(self, bucket: FlatBuffer) -> None:
        """GradSync callback: the unit's gradients have left for reduction; free its params."""
        unit = self._unit_of_buffer[id(bucket)]
        unit.reduced.add(id(bucket))
        if len(unit.reduced) == len(unit.buffers):
            unit.reduced.clear()
            unit.in_backward = False
            unit.release()

    def release_all(self) -> None:
        for u in self.units:
            u.in_backward = False
            u.release()


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
