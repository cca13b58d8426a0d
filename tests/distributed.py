"""Spawn a world of CPU processes on gloo for one test, and fail loudly if any rank fails.

Every rank runs `fn(topo_or_rank, *args)`; results come back as a list indexed by rank. An
exception on any rank fails the test with that rank's traceback; a rank that neither returns
nor fails within `timeout` seconds fails it too, and every child is killed: nothing hangs.
Starting a world costs seconds, so tests put many assertions into one world.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run `fn(rank, *args)` on `world_size` gloo ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") \
                        from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]


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
