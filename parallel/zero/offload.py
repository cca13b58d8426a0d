"""Where the optimizer states of each bucket shard live: memory (device or CPU) or files.

`MemoryStates` keeps every bucket's states resident: on the device, or on the CPU for
`offload="cpu"` (the step then runs on the CPU, as in ZeRO-Offload). `FileStates` is the NVMe
offload of ZeRO-Infinity reduced to its essence: each bucket's states (fp32 master weights, Adam
moments) live in one file per state on local disk; `checkout(i)` reads bucket i into one of
`resident` reusable staging buffers, the caller steps it in place, and the buffer is written back
on exit. The resident optimizer-state memory is therefore `resident` x the largest bucket's
states, however large the model; the staging buffers are the only state tensors allocated.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

StateSpec = dict[str, int]  # state name -> numel (all fp32)


def _initial(init: list[dict[str, torch.Tensor]] | None, i: int, name: str):
    return init[i].get(name) if init is not None else None


class MemoryStates:
    """`init[i][name]`, where given, is adopted (moved to `device` if needed) rather than
    copied, so building the optimizer never holds two fp32 master copies."""

    def __init__(self, specs: list[StateSpec], device: torch.device,
                 init: list[dict[str, torch.Tensor]] | None = None):
        self.states = []
        for i, spec in enumerate(specs):
            state = {}
            for n, k in spec.items():
                t = _initial(init, i, n)
                state[n] = t.to(device, torch.float32) if t is not None else \
                    torch.zeros(k, dtype=torch.float32, device=device)
            self.states.append(state)

    @contextmanager
    def checkout(self, i: int):
        yield self.states[i]

    def sweep(self, indices):
        for i in indices:
            yield i, self.states[i]

    def resident_bytes(self) -> int:
        return sum(t.nbytes for s in self.states for t in s.values())

    peak_resident_bytes = property(resident_bytes)

    def total_bytes(self) -> int:
        return self.resident_bytes()


class FileStates:
    def __init__(self, specs: list[StateSpec], directory: str, rank: int, resident: int = 1,
                 init: list[dict[str, torch.Tensor]] | None = None):
        self.specs, self.dir = specs, directory
        os.makedirs(directory, exist_ok=True)
        self.paths = [{n: os.path.join(directory, f"rank{rank:05d}_bucket{i:04d}_{n}.bin")
                       for n in spec} for i, spec in enumerate(specs)]
        widest = max((sum(spec.values()) for spec in specs), default=0)
        # Staging buffers, reused: the whole resident set of optimizer states.
        self._free = [torch.empty(widest, dtype=torch.float32) for _ in range(resident)]
        self._staging_bytes = sum(t.nbytes for t in self._free)
        self._in_use = 0
        self.peak_resident_bytes = 0
        zeros = torch.zeros(widest, dtype=torch.float32)
        for i, (spec, paths) in enumerate(zip(specs, self.paths)):
            for n, k in spec.items():
                t = _initial(init, i, n)
                _write(paths[n], t.detach().float().cpu() if t is not None else zeros[:k])

    def _views(self, i: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        views, off = {}, 0
        for n, k in self.specs[i].items():
            views[n] = buf[off:off + k]
            off += k
        return views

    @contextmanager
    def checkout(self, i: int):
        if not self._free:
            raise RuntimeError("nvme offload: more buckets checked out than offload_resident_buckets")
        buf = self._free.pop()
        self._in_use += 1
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._in_use * buf.nbytes)
        try:
            views = self._views(i, buf)
            for n, t in views.items():
                _read(self.paths[i][n], t)
            yield views
            for n, t in views.items():
                _write(self.paths[i][n], t)
        finally:
            self._in_use -= 1
            self._free.append(buf)

    def sweep(self, indices):
        """Yield (i, states) for each bucket in turn. With two or more staging buffers a worker
        thread reads the next bucket and writes back the previous one while the caller steps
        the current one (file I/O and torch kernels both release the GIL)."""
        indices = list(indices)
        if len(self._free) < 2 or len(indices) < 2:
            for i in indices:
                with self.checkout(i) as views:
                    yield i, views
            return
        # One worker runs loads and stores in submission order, so the store of bucket k
        # (which frees its buffer) always precedes the load of bucket k + 2 that reuses it.
        with ThreadPoolExecutor(max_workers=1) as io:
            nxt = io.submit(self._load, indices[0])
            for k, i in enumerate(indices):
                buf, views = nxt.result()
                if k + 1 < len(indices):
                    nxt = io.submit(self._load, indices[k + 1])
                yield i, views
                io.submit(self._store, i, buf, views)

    def _load(self, i: int):
        buf = self._free.pop()
        self._in_use += 1
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._in_use * buf.nbytes)
        views = self._views(i, buf)
        for n, t in views.items():
            _read(self.paths[i][n], t)
        return buf, views

    def _store(self, i: int, buf: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        for n, t in views.items():
            _write(self.paths[i][n], t)
        self._in_use -= 1
        self._free.append(buf)

    def resident_bytes(self) -> int:
        return self._staging_bytes

    def total_bytes(self) -> int:
        return 4 * sum(sum(spec.values()) for spec in self.specs)


def _read(path: str, out: torch.Tensor) -> None:
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(memoryview(out.numpy()).cast("B"))
    if n != out.nbytes:
        raise IOError(f"nvme offload: {path} holds {n} bytes, expected {out.nbytes}")


def _write(path: str, t: torch.Tensor) -> None:
    with open(path, "wb", buffering=0) as f:
        f.write(memoryview(t.contiguous().numpy()).cast("B"))


def build_states(specs: list[StateSpec], *, offload: str, device: torch.device,
                 directory: str | None, rank: int, resident: int,
                 init: list[dict[str, torch.Tensor]] | None = None):
    if offload == "nvme":
        return FileStates(specs, directory, rank, resident, init)
    return MemoryStates(specs, torch.device("cpu") if offload == "cpu" else device, init)
