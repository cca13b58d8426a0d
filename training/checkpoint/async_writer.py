"""`--async-save`: the step loop goes on while a checkpoint's rank files are written.

A save then blocks training only for the first phases of the synchronous save (room for it, a
fresh `.tmp` folder: `training/checkpoint/format.py`) and for a copy of the rank's tensors into
host memory (pinned when they live on an accelerator, so the copy runs at full bandwidth). A
background thread writes that copy as the usual rank file (same safetensors layout, same
per-tensor checksums, flushed to disk). The commit is unchanged too, and runs on the main thread:
once every rank's thread has finished (`poll`, a one-number all-reduce per iteration while a save
is in flight), the ranks agree that every file was written, rank 0 writes meta.json, renames the
folder and moves `latest`, then retention (--keep-last/--keep-every) runs. So `latest` names the
new checkpoint only once every rank's shards are durable; a crash or a failed write before that
leaves `latest` on the previous checkpoint, and the `.tmp` folder (no meta.json) is never a
resume candidate.

At most one save is in flight: the next save, a rollback and the end of the run first wait for
the previous one (`wait`). The host copy is kept and reused by the next save of the same tensors,
so only the first save pays for the allocation.

Every rank calls `start`, `poll` and `wait` at the same points (they are collectives, like the
synchronous save); the writer thread itself never communicates.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from megazoo.training.checkpoint import format as ckpt

logger = logging.getLogger(__name__)


def host_copy(tensors: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `tensors` in host memory that training cannot change, reusing `buffers` (the
    previous copy) where name, shape and dtype match; `buffers` is updated in place."""
    on_device = None
    for name, t in tensors.items():
        t = t.detach()
        buf = buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # pinned host memory lets the device-to-host copy run asynchronously at full speed
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type != "cpu")
            buffers[name] = buf
        buf.copy_(t, non_blocking=t.device.type != "cpu")
        on_device = t.device if t.device.type != "cpu" else on_device
    for name in set(buffers) - set(tensors):
        del buffers[name]
    if on_device is not None:  # the non-blocking copies land before the writer reads them
        torch.accelerator.synchronize(on_device)
    return dict(buffers)


@dataclass
class _InFlight:
    root: str
    iteration: int
    meta: dict
    thread: threading.Thread | None
    on_commit: object  # called (on every rank) after the commit; retention runs there
    began: float  # time.perf_counter() when the save began
    copied: float  # seconds `start` held the step loop (opening agreements, host copy)
    error: BaseException | None = None
    written: float = 0.0  # seconds the background write took
    polls: float = 0.0  # seconds in the per-iteration agreements and the commit
    waited: float = 0.0  # seconds the step loop waited for the write to end (`wait`)


class AsyncCheckpointWriter:
    """One rank's background checkpoint writer (at most one save in flight)."""

    def __init__(self, rank: int, world_size: int, device=None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: _InFlight | None = None
        self.saves: list[dict] = []  # per committed save: where the step loop was blocked, seconds

    @property
    def in_flight(self) -> int | None:
        """The iteration being written, or None."""
        return self._pending.iteration if self._pending else None

    def start(self, root: str, iteration: int, tensors: dict[str, torch.Tensor], meta: dict,
              on_commit=None) -> str:
        """Collective: copy this rank's tensors to host memory and write them in the background.
        Returns the folder the checkpoint will have once committed."""
        if self._pending is not None and self._pending.thread.is_alive() and self.rank == 0:
            logger.warning("the checkpoint of iteration %d waits for the write of iteration %d, "
                           "still running; a longer --save-interval avoids the stall", iteration,
                           self._pending.iteration)
        self.wait()  # at most one save in flight (its wait counts as that save's stall)
        began = time.perf_counter()
        copy = {}
        tmp = ckpt.begin_save(root, iteration, self.rank, self.world_size, tensors, self.device,
                              then=lambda: copy.update(self._copy(tensors)))
        pending = _InFlight(root, iteration, meta, None, on_commit, began,
                            time.perf_counter() - began)
        pending.thread = threading.Thread(target=self._write, args=(pending, tmp, copy),
                                          daemon=True, name=f"checkpoint-writer-{iteration}")
        self._pending = pending
        pending.thread.start()
        return ckpt.iteration_dir(root, iteration)

    def _copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            return host_copy(tensors, self._buffers)
        except (RuntimeError, MemoryError) as e:  # no host (pinned) memory for the copy
            self._buffers.clear()
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ckpt.CheckpointError(f"rank {self.rank}: no host memory for --async-save's copy "
                                       f"of its tensors ({first}); free host memory or save "
                                       f"without --async-save") from None

    def _write(self, pending: _InFlight, tmp: str, tensors: dict[str, torch.Tensor]) -> None:
        begin = time.perf_counter()
        try:
            ckpt.write_rank_file(tmp, self.rank, tensors)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
            pending.error = e
        pending.written = time.perf_counter() - begin

    def poll(self) -> str | None:
        """Collective, cheap: commit the save in flight if every rank has written its file.
        Returns the committed folder, else None (nothing in flight, or still writing). A
        collective outside the step: the trainer runs it inside a watchdog phase."""
        pending = self._pending
        if pending is None:
            return None
        begin = time.perf_counter()
        done = ckpt.all_ranks_ok(not pending.thread.is_alive(), self.device)
        pending.polls += time.perf_counter() - begin
        return self._commit() if done else None

    def wait(self) -> str | None:
        """Collective: wait for the save in flight (if any) and commit it; returns its folder."""
        if self._pending is None:
            return None
        begin = time.perf_counter()
        self._pending.thread.join()
        self._pending.waited += time.perf_counter() - begin
        return self._commit()

    def _commit(self) -> str:
        pending, self._pending = self._pending, None
        begin = time.perf_counter()
        try:
            folder = ckpt.finish_save(pending.root, pending.iteration, self.rank, self.world_size,
                                      pending.meta, self.device, write=lambda: _raise(pending.error))
            if pending.on_commit is not None:
                pending.on_commit()
        finally:
            pending.polls += time.perf_counter() - begin
        stall = dict(iteration=pending.iteration, copied=pending.copied, polls=pending.polls,
                     waited=pending.waited, written=pending.written)
        self.saves.append(stall)
        if self.rank == 0:
            logger.info("checkpoint %s: written in the background in %.2f s, committed %.2f s after "
                        "the save began; the step loop was blocked %.3f s (host copy %.3f s, "
                        "agreements and commit %.3f s, waiting for the write %.3f s)", folder,
                        pending.written, time.perf_counter() - pending.began,
                        pending.copied + pending.polls + pending.waited, pending.copied,
                        pending.polls, pending.waited)
        return folder

    def abandon(self) -> None:
        """The run failed: let the write in flight end, commit nothing (its `.tmp` folder is not a
        checkpoint; `latest` stays on the previous one)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join()
            logger.warning("checkpoint of iteration %d not committed (the run ended while it was "
                           "written); %s/latest names the previous one", pending.iteration,
                           pending.root)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
