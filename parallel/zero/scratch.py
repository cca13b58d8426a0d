"""Reusable transient gradient buckets (ZeRO-2/3).

Under ZeRO-2/3 a bucket's full gradient lives only from its first gradient until its reduction
has landed in the persistent shard. Allocating it afresh every micro-batch costs more than the
memory: a buffer of tens of megabytes is a fresh mapping (or freshly trimmed heap) on a CPU, so
every 4 KiB page faults on first touch and is zeroed by the kernel, every step. `ScratchPool`
keeps the buffers that come back and hands them out again: best fit among the free ones of the
same dtype and device (a view of its first `numel` elements), else a new one, allocated through
`host_memory.empty_large` (huge pages on a Linux CPU; `torch.empty` elsewhere).

The pool never holds more than `limit` free buffers (the gradient sync passes the most it keeps
alive at once, `max_inflight_buckets + 1`), so the transient buckets' high-water mark inside a
step is what it was; between steps the pool holds them instead of the allocator.
`held_bytes()` is reported by `ZeroOptimizer.memory_report()` as `grad_scratch`.
"""
from __future__ import annotations

import torch

from ..kernels.host_memory import empty_large


class ScratchPool:
    def __init__(self, limit: int):
        self.limit = limit
        self._free: list[torch.Tensor] = []  # flat buffers not handed out

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements (use its first `numel`), contents
        undefined; hand the buffer itself back with `give`."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel and b.dtype == dtype
                and b.device == device]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return empty_large((numel,), dtype, device)

    def give(self, buf: torch.Tensor) -> None:
        """Take back a buffer from `take`; the caller no longer touches it."""
        self._free.append(buf)
        if len(self._free) > self.limit:  # drop the smallest: the larger ones fit any request
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps between uses."""
        return sum(b.numel() * b.element_size() for b in self._free)
