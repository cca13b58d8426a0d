"""The logging window: what the steps between two log lines add up to (loss, tokens, time), turned
into the logged metrics (throughput, TFLOP/s, MFU, memory), and the straggler check over it."""
from __future__ import annotations

import logging

import torch

from megazoo.parallel import collectives as C
from megazoo.training.monitor.metrics import mfu, peak_memory_bytes

logger = logging.getLogger(__name__)


class LogWindow:
    def __init__(self, flops_per_token: float, peak_flops: float, topo, first_step: int):
        self.flops_per_token, self.peak, self.topo = flops_per_token, peak_flops, topo
        # The first step of a (re)start pays one-off costs unevenly across ranks (connections,
        # allocations, kernel choice): its window is not judged for stragglers.
        self.first_step = first_step
        self.reset()

    def reset(self) -> None:
        self.loss, self.n, self.tokens, self.time, self.lag, self.wall = 0.0, 0, 0, 0.0, 0.0, 0.0

    def add(self, loss: float, tokens: int, seconds: float, lag: float, wall: float) -> None:
        """One step: its loss, tokens, compute seconds (forward, backward, optimizer), time until it
        was ready to reduce, and wall seconds (the batch's reading included)."""
        self.loss += loss
        self.n += 1
        self.tokens += tokens
        self.time += seconds
        self.lag += lag
        self.wall += wall

    def metrics(self, opt, step, state, batch: int) -> dict:
        """The window's train metrics (collective: the memory peak is the maximum over ranks)."""
        tokens_s = self.tokens / self.time
        flops_rank = self.flops_per_token * tokens_s / self.topo.world_size
        last = step or opt
        out = dict(loss=self.loss / self.n, lr=opt.lr, grad_norm=step.grad_norm if step else float("nan"),
                   loss_scale=last.loss_scale, skipped=state.skipped_steps, batch=batch,
                   consumed_samples=state.consumed_samples, ms_per_iter=1e3 * self.wall / self.n,
                   tokens_per_s=tokens_s, tflops_per_rank=flops_rank / 1e12)
        if self.peak:  # no peak, no MFU (training/monitor/metrics.py)
            out["mfu"] = mfu(flops_rank, self.peak)
        out["mem_gib"] = max_over_ranks(peak_memory_bytes(self.topo.device), self.topo) / 2**30
        return out

    def check_stragglers(self, threshold: float, journal, iteration: int) -> None:
        if iteration - self.n >= self.first_step:
            check_stragglers(self.lag, self.n, self.topo, threshold, journal, iteration)


def check_stragglers(ready_time: float, steps: int, topo, threshold: float, journal,
                     iteration: int) -> None:
    """Name the ranks that lag. Waiting inside collectives makes every rank's step equally long,
    so what is compared is each rank's time from the start of the step until it was ready for
    the step's global loss reduction, summed over the log interval."""
    if C.is_single(topo.world_group):
        return
    t = torch.tensor([ready_time], dtype=torch.float64, device=topo.device)
    times = C.all_gather(t, topo.world_group).tolist()
    if topo.rank != 0:
        return
    median = sorted(times)[(len(times) - 1) // 2]  # the lower median: with 2 ranks, the faster
    # 1 ms per step of slack keeps scheduler noise on tiny steps from naming anyone.
    slow = [r for r, x in enumerate(times) if x > threshold * median + 1e-3 * steps]
    if slow:
        logger.warning("iteration %d: slow ranks %s (%s s to reach the loss reduction over %d steps, "
                       "median %.3g s)", iteration, slow, [round(times[r], 3) for r in slow], steps,
                       median)
        journal.event("straggler", iteration=iteration, ranks=slow, times=times)


def max_over_ranks(value: int, topo) -> int:
    t = torch.tensor([float(value)], device=topo.device)
    C.all_reduce(t, topo.world_group, op=C.ReduceOp.MAX)
    return int(t.item())
