"""Reusable transient gradient buckets (ZeRO-2/3).

Under ZeRO-2/3 a bucket's full gradient lives only from its first gradient until its reduction
has landed in the persistent shard. Allocating it afresh every micro-batch costs more than the
memory: a buffer of tens of megabytes is a fresh mapping (or freshly trimmed heap) on a CPU, so
every 4 KiB page faults on first touch and is zeroed by the kernel, every step (on this
project's 2-core VM: ~11,000 faults per ZeRO-2 step of a 17M-parameter model, the transient
buckets and gloo's copies of them). `ScratchPool` keeps the buffers that come back and hands
them out again.

Every pooled buffer has one size, the widest transient bucket's (`numel`), so any free buffer
serves any request: the pool holds as many buffers as were ever out at once (the in-flight
reductions plus the buckets being filled, what the allocator held at that moment before) and,
from the second step on, allocates nothing. A bucket narrower than half of that width is not
worth a buffer up to twice its size: it gets `torch.empty` as before (such buckets are small,
the allocator's heap reuses them). New buffers come from `host_memory.empty_large` (huge pages
on a Linux CPU, `torch.empty` elsewhere). `held_bytes()` is what `ZeroOptimizer.memory_report()`
reports as `grad_scratch`.
"""
from __future__ import annotations

import torch

from ..kernels.host_memory import empty_large


class ScratchPool:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._free: list[torch.Tensor] = []  # pooled buffers not handed out
        self.created = 0  # pooled buffers allocated so far (constant once warm)

    def take(self, numel: int) -> torch.Tensor:
        """A flat buffer of at least `numel` elements (use its first `numel`), contents
        undefined; hand it back with `give` once nothing reads it any more."""
        if 2 * numel < self.numel:
            return torch.empty(numel, dtype=self.dtype, device=self.device)
        if self._free:
            return self._free.pop()
        self.created += 1
        return empty_large((self.numel,), self.dtype, self.device)

    def give(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.numel:  # a pooled one (the narrow ones are simply dropped)
            self._free.append(buf)

    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps between uses."""
        return len(self._free) * self.numel * torch.empty((), dtype=self.dtype).element_size()
