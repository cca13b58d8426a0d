"""Spawn a world of CPU processes on gloo for one test, and fail loudly if any rank fails.

Every rank runs `fn(topo_or_rank, *args)`; results come back as a list indexed by rank. An
exception on any rank fails the test with that rank's traceback; a rank that neither returns
nor fails within `timeout` seconds fails it too, and every child is killed: nothing hangs.
The processes are kept for the session's next world (spawning them and importing torch costs
seconds; see `run_distributed`; new ones are forked from a server that imported torch and the test
helpers once), and a world that fails takes only its own processes down;
building a world's models still costs time, so tests put many assertions into one world.
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp
from multiprocessing.connection import wait


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Torch's default generator seed in a fresh process: a reused rank starts each world from it too.
_FRESH_SEED = 67280421310721


def _enter_world(rank: int, world_size: int, port: int, env: dict, cwd: str) -> None:
    """The process environment a freshly spawned rank would have had, then its gloo group."""
    import torch
    import torch.distributed as dist
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.chdir(cwd)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.manual_seed(_FRESH_SEED)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _leave_world() -> None:
    import logging

    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    root = logging.getLogger()  # a run's logging.basicConfig: the next world starts without it
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.WARNING)


def _child(rank: int, world_size: int, port: int, fn, args, results) -> None:
    """A rank spawned for one world only (`fresh=True`)."""
    try:
        _enter_world(rank, world_size, port, dict(os.environ), os.getcwd())
        out = fn(rank, *args)
        results.put((None, rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((None, rank, "error", traceback.format_exc()))
    finally:
        _leave_world()


def _pooled(tasks, results) -> None:
    """A process kept for many worlds: each task is one rank of one world (starting a process
    and importing torch costs seconds; joining a new gloo group costs milliseconds). `results`
    is this process's own pipe: a process killed mid-write corrupts nothing the others use."""
    import torch
    torch.set_num_threads(1)
    while True:
        meta = tasks.get()
        if meta is None:
            return
        task_id, rank, world_size, port, env, cwd = meta
        try:
            fn, args = tasks.get()  # unpickled here: an import error is this rank's failure
            _enter_world(rank, world_size, port, env, cwd)
            out = fn(rank, *args)
            results.send((task_id, rank, "ok", out))
        except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
            results.send((task_id, rank, "error", traceback.format_exc()))
        finally:
            _leave_world()


class _Rank:
    """One kept process: its task queue and the reading end of its own result pipe."""

    def __init__(self, ctx):
        self.tasks = ctx.Queue()
        self.results, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_pooled, args=(self.tasks, writer), daemon=True)
        self.proc.start()
        writer.close()  # the child holds the only writer: its death reads as end of file here

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.tasks.close()
        self.tasks.cancel_join_thread()
        self.results.close()


class _Pool:
    """Spawned ranks reused from world to world. A world that fails or times out takes its own
    processes down (they may be stuck in a collective); the session's other kept processes took
    no part in it and serve the next worlds, which spawn replacements only for the ranks lost."""

    def __init__(self):
        # forked from one server process that imported torch and the test helpers once (the
        # pool's first world and every later new rank start in well under a second instead of
        # seconds each); nothing runs in the server but those imports
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "tests.distributed", "tests.helpers",
                                         "megazoo.training.run.loop", "megazoo.models.registry"])
        self.ranks: list[_Rank] = []
        self.count = 0

    def take(self, n: int) -> list[_Rank]:
        for r in [r for r in self.ranks if not r.proc.is_alive()]:
            r.close()
            self.ranks.remove(r)
        while len(self.ranks) < n:
            self.ranks.append(_Rank(self.ctx))
        return self.ranks[:n]

    def submit(self, world_size: int, fn, args):
        ranks = self.take(world_size)
        self.count += 1
        port, env, cwd = free_port(), dict(os.environ), os.getcwd()
        for r, kept in enumerate(ranks):
            kept.tasks.put((self.count, r, world_size, port, env, cwd))
            kept.tasks.put((fn, args))
        return ranks, self.count

    def discard(self, ranks: list[_Rank]) -> None:
        for r in ranks:
            r.close()
            if r in self.ranks:
                self.ranks.remove(r)

    def close(self) -> None:
        self.discard(list(self.ranks))


_POOL: list[_Pool] = []  # the test session's reused ranks (created on first use)


def _pool() -> _Pool:
    if not _POOL:
        _POOL.append(_Pool())
        atexit.register(_POOL[0].close)
    return _POOL[0]


def _check(rank: int, world_size: int, status: str, payload):
    if status == "error":
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
    return payload


def _collect(procs, results, task_id, world_size: int, timeout: float) -> list:
    """The fresh world's results (one queue shared by its ranks)."""
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        try:
            got, rank, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in outputs and p.exitcode not in (None, 0)]
            _raise_if_lost(dead, [procs[r].exitcode for r in dead], outputs, world_size, deadline,
                           timeout)
            continue
        if got == task_id:
            outputs[rank] = _check(rank, world_size, status, payload)
    return [outputs[r] for r in range(world_size)]


def _raise_if_lost(dead, codes, outputs, world_size, deadline, timeout) -> None:
    if dead:
        raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
    if time.monotonic() > deadline:
        missing = sorted(set(range(world_size)) - set(outputs))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None


def _collect_pooled(ranks: list[_Rank], task_id, timeout: float) -> list:
    """The kept ranks' results, each from its own pipe."""
    world_size = len(ranks)
    outputs: dict[int, object] = {}
    ended: set[int] = set()  # ranks whose pipe closed without a result
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        waiting = {ranks[r].results: r for r in range(world_size) if r not in outputs}
        for conn in wait(list(waiting), timeout=0.5):
            r = waiting[conn]
            try:
                got, rank, status, payload = conn.recv()
            except (EOFError, OSError):  # the process ended without a result
                ranks[r].proc.join(timeout=5)
                ended.add(r)
                continue
            if got == task_id:
                outputs[rank] = _check(rank, world_size, status, payload)
        dead = [r for r in range(world_size) if r not in outputs and
                (r in ended or ranks[r].proc.exitcode not in (None, 0))]
        _raise_if_lost(dead, [ranks[r].proc.exitcode for r in dead], outputs, world_size,
                       deadline, timeout)
    return [outputs[r] for r in range(world_size)]


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, fresh: bool = False) -> list:
    """Run `fn(rank, *args)` on `world_size` gloo ranks; return the per-rank results.

    The ranks are processes kept from earlier worlds of the session, each entering the world
    as a spawned one would: the caller's environment and working directory, float32 default
    dtype, grad mode on, one thread, torch's fresh-process seed, no root log handler.
    `fresh=True` (or MEGAZOO_TEST_FRESH_WORLDS=1) spawns new processes for this world only.
    """
    if fresh or os.environ.get("MEGAZOO_TEST_FRESH_WORLDS") == "1":
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, None, world_size, timeout)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    pool = _pool()
    ranks, task_id = pool.submit(world_size, fn, args)
    try:
        return _collect_pooled(ranks, task_id, timeout)
    except BaseException:
        pool.discard(ranks)  # this world's processes only: the others took no part in it
        raise


def sum_tied_embedding_grads(chunks, topo) -> None:
    """Reference for pipelines run without the optimizer: sum the tied embedding's gradient over
    the first and last stage, as the gradient sync does inside its buckets in training."""
    import torch
    from megazoo.parallel import collectives as C
    from megazoo.parallel.pipeline.tied import embedding_group, tied_parameters
    group = embedding_group(topo)
    if C.is_single(group):
        return
    for p in tied_parameters(chunks):
        if p.grad is None:  # a stage whose loss did not reach it still takes part in the sum
            p.grad = torch.zeros_like(p)
        C.all_reduce(p.grad, group)


def all_reduce_each(tensors, group) -> None:
    """Sum each tensor over `group` in place with one collective for all of them (a world's
    cost is mostly its collectives' round trips: one per parameter adds up); the same sums as
    one all-reduce per tensor, up to the order in which more than two ranks' values are added."""
    import torch
    from megazoo.parallel import collectives as C
    tensors = list(tensors)
    if not tensors or C.group_size(group) == 1:
        return
    flat = C.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
