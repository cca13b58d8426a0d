"""`pretrain`: topology, model chunks, optimizer and data, then train / evaluate / save.

    topo   = initialize(parallel layout)             torch.distributed from torchrun's environment
    chunks = this rank's pipeline chunks             model_provider(config, topo, pre/post, layers)
    opt    = ZeRO optimizer over the chunks
    loop:  microbatches -> forward_backward -> health check -> optimizer step -> log -> evaluate
           -> save (every N iterations, on SIGTERM)

Resume is exact: the checkpoint holds the weights, optimizer shards, loss scaler, every rank's
RNG streams, the iteration and the consumed-samples count (the LR and batch-size schedules are
pure functions of those counters).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.pipeline.tied import broadcast_tied_embedding
from parallel.random import model_parallel_seed
from parallel.topology import initialize
from parallel.zero.optimizer import build_optimizer

from . import checkpointing as ckpt
from .resume import TrainState, layout_of, load, save
from .config import RunConfig
from .data import TrainData, build_datasets, microbatches
from .health import HealthConfig, HealthMonitor, Verdict
from .journal import RunJournal
from .log import RunLogger
from .lr_schedule import global_batch_size, learning_rate
from .metrics import device_peak_flops, peak_memory_bytes
from .report import write_report
from .step import activation_shape, eval_step, forward_backward
from .watchdog import CollectiveWatchdog

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float]  # training loss of every iteration run in this process
    valid_losses: list[tuple[int, float]]
    checkpoint: str | None


class _SigtermFlag:
    """SIGTERM asks for a checkpoint at the end of the current step, then a clean exit."""

    def __init__(self):
        self.raised = False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_):
        self.raised = True

    def any_rank(self, device) -> bool:
        t = torch.tensor([1.0 if self.raised else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def restore(self):
        signal.signal(signal.SIGTERM, self._old)


def build_chunks(model_provider, run: RunConfig, topo, rng):
    specs = topo.config.chunk_specs(run.model.num_layers, topo.pp_rank)
    chunks = [model_provider(run.model, topo, rng=rng, **spec.kwargs()) for spec in specs]
    if topo.pp > 1:
        broadcast_tied_embedding(chunks, topo)
    return chunks


def pretrain(model_provider, run: RunConfig) -> TrainResult:
    topo = initialize(run.parallel)
    rng = model_parallel_seed(run.seed, topo)
    chunks = build_chunks(model_provider, run, topo, rng)
    opt = build_optimizer(chunks, topo, run.optimizer)
    state = load(run, topo, chunks, opt, rng) if run.checkpoint.load else TrainState()
    journal = RunJournal(run.run_dir)
    watchdog = CollectiveWatchdog(run.health.collective_timeout, topo.rank, topo.world_size,
                                  on_timeout=lambda msg: journal.event("hang", rank=topo.rank, detail=msg))

    sched, mcfg, seq = run.schedule, run.model, run.data.seq_length
    mbs, gbs = sched.micro_batch_size, sched.global_batch_size
    evals = sched.train_iters // max(run.logging.eval_interval, 1) + 1
    train_ds, valid_ds, _ = build_datasets(
        run.data, seed=run.seed, vocab_size=mcfg.vocab_size,
        num_samples=(sched.train_iters * gbs, evals * run.logging.eval_iters * gbs, 0))
    data = TrainData(train_ds, journal.skipped_samples(), micro_batch_size=mbs, dp_rank=topo.dp_rank,
                     dp=topo.dp, device=topo.device, cp=topo.cp, cp_rank=topo.cp_rank)
    data.restart(state.consumed_samples)
    shape = activation_shape(topo, seq, mbs, mcfg.hidden_size)
    flops_per_token = mcfg.model_flops_per_token(seq)
    peak, peak_source = device_peak_flops(topo.device, run.logging.peak_flops)
    log = RunLogger(run.logging, {"run": dataclasses.asdict(run)}, topo.rank == 0, journal)
    if topo.rank == 0:
        logger.info("model: %.2fM parameters; layout %s; peak %.3g FLOP/s per rank (%s)",
                    mcfg.num_parameters() / 1e6, layout_of(run, topo), peak, peak_source)
        logger.info("memory per rank (bytes): %s", opt.memory_report())

    monitor, rollbacks, nan_injected = HealthMonitor(run.health), 0, False
    sigterm, result = _SigtermFlag(), TrainResult(state, [], [], None)
    window = dict(loss=0.0, n=0, tokens=0, time=0.0, lag=0.0)
    # The first step of a (re)start pays one-off costs unevenly across ranks (connections,
    # allocations, kernel choice): its window is not judged for stragglers.
    first_step = state.iteration + 1
    try:
        while state.iteration < sched.train_iters:
            it = state.iteration + 1  # the iteration this step makes
            step_begin, timings = time.perf_counter(), {}
            batch = global_batch_size(sched, state.consumed_samples)
            microbatch_list = data.next_global_batch(batch)
            opt.lr = learning_rate(sched, state.iteration)
            _maybe_hang(run.health, topo.rank, it)
            poison = run.health.inject_nan_at == it and not nan_injected
            nan_injected |= poison
            start = time.perf_counter()
            loss = forward_backward(chunks, microbatch_list, topo, opt, schedule=sched.pipeline_schedule,
                                    shape=shape, watchdog=watchdog, poison=poison, timings=timings)
            verdict = monitor.check(loss)
            step = None
            if verdict.healthy or run.health.policy == "warn":
                with watchdog.collective("optimizer step (dp reduce, grad norm, all-gather)"):
                    step = opt.step(loss=loss)
                if step.skipped and verdict.healthy:
                    verdict = Verdict(False, "nonfinite", step.reason)
            else:  # skip / rollback: drop this step's update
                opt.grad_sync.finish()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            if not verdict.healthy:
                samples = data.physical_ranges(state.consumed_samples, batch)
                _report_unhealthy(journal, topo, it, verdict, samples, run.health.policy)
                if run.health.policy == "rollback":
                    rollbacks += 1
                    if rollbacks > run.health.max_rollbacks:
                        raise RuntimeError(f"{rollbacks} rollbacks in one run (more than "
                                           f"max_rollbacks={run.health.max_rollbacks}); stopping")
                    state = _roll_back(run, topo, chunks, opt, rng, data, journal, it, samples)
                    result.state = state
                    continue
            else:
                monitor.record_healthy(loss)
            state.iteration += 1
            state.consumed_samples += batch
            state.skipped_steps += int(step is None or step.skipped)
            result.losses.append(loss)
            window.update(loss=window["loss"] + loss, n=window["n"] + 1,
                          tokens=window["tokens"] + batch * seq, time=window["time"] + elapsed,
                          lag=window["lag"] + timings["ready"] - step_begin)
            if state.iteration % run.logging.log_interval == 0 or state.iteration == sched.train_iters:
                tokens_s = window["tokens"] / window["time"]
                flops_rank = flops_per_token * tokens_s / topo.world_size
                last = step or opt
                log.log(dict(loss=window["loss"] / window["n"], lr=opt.lr,
                             grad_norm=step.grad_norm if step else float("nan"),
                             loss_scale=last.loss_scale, skipped=state.skipped_steps,
                             batch=batch, tokens_per_s=tokens_s,
                             tflops_per_rank=flops_rank / 1e12,
                             mfu=flops_rank / peak if peak else float("nan"),
                             mem_gib=_max_over_ranks(peak_memory_bytes(topo.device), topo) / 2**30),
                        state.iteration)
                if state.iteration - window["n"] >= first_step:
                    _check_stragglers(window["lag"], window["n"], topo,
                                      run.health.straggler_threshold, journal, state.iteration)
                window = dict(loss=0.0, n=0, tokens=0, time=0.0, lag=0.0)
            if valid_ds is not None and run.logging.eval_interval and \
                    state.iteration % run.logging.eval_interval == 0:
                vloss = evaluate(chunks, valid_ds, topo, run, shape, opt.cfg.model_dtype, state)
                result.valid_losses.append((state.iteration, vloss))
                log.log(dict(loss=vloss, ppl=math.exp(min(vloss, 50))), state.iteration, "valid")
            stop = sigterm.any_rank(topo.device)
            interval = run.checkpoint.save_interval
            if run.checkpoint.save and (stop or (interval and state.iteration % interval == 0)):
                result.checkpoint = save(run, topo, chunks, opt, rng, state)
            if stop:
                logger.warning("SIGTERM: checkpoint written, stopping at iteration %d", state.iteration)
                break
        if run.checkpoint.save and result.checkpoint != ckpt.iteration_dir(run.checkpoint.save,
                                                                           state.iteration):
            result.checkpoint = save(run, topo, chunks, opt, rng, state)  # the final state
        if topo.rank == 0 and run.run_dir:
            logger.info("run report: %s", write_report(run.run_dir))
    finally:
        sigterm.restore()
        log.close()
    return result


def _maybe_hang(cfg: HealthConfig, rank: int, iteration: int) -> None:
    """Fault drill (--inject-hang): this rank stalls before its next collective."""
    if cfg.inject_hang and cfg.inject_hang[0] == rank and cfg.inject_hang[1] == iteration:
        logger.warning("fault drill: rank %d sleeps %.0f s at iteration %d", rank, cfg.inject_hang[2],
                       iteration)
        time.sleep(cfg.inject_hang[2])


def _report_unhealthy(journal, topo, iteration, verdict, samples, policy) -> None:
    action = {"warn": "kept", "skip": "update dropped", "rollback": "rolling back"}[policy]
    logger.warning("iteration %d: %s (%s) on rank %d; data samples %s; %s", iteration, verdict.kind,
                   verdict.detail, topo.rank, samples, action)
    if topo.rank == 0:
        journal.event(verdict.kind, iteration=iteration, rank=topo.rank, detail=verdict.detail,
                      samples=samples, policy=policy)


def _roll_back(run, topo, chunks, opt, rng, data, journal, iteration, samples) -> TrainState:
    """Reload the latest checkpoint, leave the offending samples out of the stream, carry on."""
    source = dataclasses.replace(run, checkpoint=dataclasses.replace(
        run.checkpoint, load=run.checkpoint.save, finetune=False))
    state = load(source, topo, chunks, opt, rng)
    data.skip(samples)
    data.restart(state.consumed_samples)
    if topo.rank == 0:
        journal.event("skip_samples", iteration=iteration, ranges=samples)
        journal.event("rollback", iteration=iteration, to_iteration=state.iteration, samples=samples)
    logger.warning("rolled back from iteration %d to %d; samples %s will be skipped", iteration,
                   state.iteration, samples)
    return state


def _check_stragglers(ready_time: float, steps: int, topo, threshold: float, journal,
                      iteration: int) -> None:
    """Name the ranks that lag. Waiting inside collectives makes every rank's step equally long,
    so what is compared is each rank's time from the start of the step until it was ready for
    the step's global loss reduction, summed over the log interval."""
    if not dist.is_initialized() or topo.world_size == 1:
        return
    t = torch.tensor([ready_time], dtype=torch.float64, device=topo.device)
    times = [torch.zeros_like(t) for _ in range(topo.world_size)]
    dist.all_gather(times, t)
    if topo.rank != 0:
        return
    times = [x.item() for x in times]
    median = sorted(times)[(len(times) - 1) // 2]  # the lower median: with 2 ranks, the faster
    # 1 ms per step of slack keeps scheduler noise on tiny steps from naming anyone.
    slow = [r for r, x in enumerate(times) if x > threshold * median + 1e-3 * steps]
    if slow:
        logger.warning("iteration %d: slow ranks %s (%s s to reach the loss reduction over %d steps, "
                       "median %.3g s)", iteration, slow, [round(times[r], 3) for r in slow], steps,
                       median)
        journal.event("straggler", iteration=iteration, ranks=slow, times=times)


def evaluate(chunks, dataset, topo, run: RunConfig, shape, dtype, state: TrainState) -> float:
    """Validation loss over --eval-iters global batches (the same batches at every evaluation)."""
    mbs = run.schedule.micro_batch_size
    it = microbatches(dataset, consumed_samples=0, micro_batch_size=mbs, dp_rank=topo.dp_rank,
                      dp=topo.dp, device=topo.device, cp=topo.cp, cp_rank=topo.cp_rank)
    per_step = run.schedule.global_batch_size // (mbs * topo.dp)
    losses = [eval_step(chunks, [next(it) for _ in range(per_step)], topo, shape=shape, dtype=dtype)
              for _ in range(run.logging.eval_iters)]
    return sum(losses) / len(losses)


def _max_over_ranks(value: int, topo) -> int:
    t = torch.tensor([float(value)], device=topo.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
