"""`pretrain`: topology, model chunks, optimizer and data, then train / evaluate / save.

    topo   = initialize(parallel layout)             torch.distributed from torchrun's environment
    chunks = this rank's pipeline chunks             model_provider(config, topo, pre/post, layers)
    opt    = ZeRO optimizer over the chunks
    loop:  microbatches -> train_step -> log -> evaluate -> save (every N iterations, on SIGTERM)

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

from parallel.pipeline.partition import rank_chunks
from parallel.pipeline.tied import broadcast_tied_embedding
from parallel.random import model_parallel_seed
from parallel.topology import initialize
from parallel.zero.optimizer import build_optimizer

from . import checkpointing as ckpt
from .resume import TrainState, layout_of, load, save
from .config import RunConfig
from .data import build_datasets, microbatches
from .log import RunLogger
from .lr_schedule import global_batch_size, learning_rate
from .metrics import device_peak_flops, model_flops_per_token, peak_memory_bytes
from .step import activation_shape, eval_step, train_step

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
    specs = rank_chunks(run.model.num_layers, topo.pp, topo.vpp, topo.pp_rank)
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

    sched, mcfg, seq = run.schedule, run.model, run.data.seq_length
    mbs, gbs = sched.micro_batch_size, sched.global_batch_size
    evals = sched.train_iters // max(run.logging.eval_interval, 1) + 1
    train_ds, valid_ds, _ = build_datasets(
        run.data, seed=run.seed, vocab_size=mcfg.vocab_size,
        num_samples=(sched.train_iters * gbs, evals * run.logging.eval_iters * gbs, 0))
    train_iter = microbatches(train_ds, consumed_samples=state.consumed_samples, micro_batch_size=mbs,
                              dp_rank=topo.dp_rank, dp=topo.dp, device=topo.device)
    shape = activation_shape(topo, seq, mbs, mcfg.hidden_size)
    flops_per_token = model_flops_per_token(mcfg, seq)
    peak, peak_source = device_peak_flops(topo.device, run.logging.peak_flops)
    log = RunLogger(run.logging, {"run": dataclasses.asdict(run)}, enabled=topo.rank == 0)
    if topo.rank == 0:
        logger.info("model: %.2fM parameters; layout %s; peak %.3g FLOP/s per rank (%s)",
                    mcfg.num_parameters() / 1e6, layout_of(run, topo), peak, peak_source)
        logger.info("memory per rank (bytes): %s", opt.memory_report())

    sigterm, result = _SigtermFlag(), TrainResult(state, [], [], None)
    window = dict(loss=0.0, n=0, tokens=0, time=0.0)
    try:
        while state.iteration < sched.train_iters:
            batch = global_batch_size(sched, state.consumed_samples)
            mbs_list = [next(train_iter) for _ in range(batch // (mbs * topo.dp))]
            opt.lr = learning_rate(sched, state.iteration)
            start = time.perf_counter()
            loss, step = train_step(chunks, mbs_list, topo, opt, schedule=sched.pipeline_schedule,
                                    shape=shape)
            elapsed = time.perf_counter() - start
            state.iteration += 1
            state.consumed_samples += batch
            state.skipped_steps += int(step.skipped)
            result.losses.append(loss)
            window.update(loss=window["loss"] + loss, n=window["n"] + 1,
                          tokens=window["tokens"] + batch * seq, time=window["time"] + elapsed)
            if state.iteration % run.logging.log_interval == 0 or state.iteration == sched.train_iters:
                tokens_s = window["tokens"] / window["time"]
                flops_rank = flops_per_token * tokens_s / topo.world_size
                log.log(dict(loss=window["loss"] / window["n"], lr=opt.lr, grad_norm=step.grad_norm,
                             loss_scale=step.loss_scale, skipped=state.skipped_steps,
                             batch=batch, tokens_per_s=tokens_s,
                             tflops_per_rank=flops_rank / 1e12,
                             mfu=flops_rank / peak if peak else float("nan"),
                             mem_gib=_max_over_ranks(peak_memory_bytes(topo.device), topo) / 2**30),
                        state.iteration)
                window = dict(loss=0.0, n=0, tokens=0, time=0.0)
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
    finally:
        sigterm.restore()
        log.close()
    return result


def evaluate(chunks, dataset, topo, run: RunConfig, shape, dtype, state: TrainState) -> float:
    """Validation loss over --eval-iters global batches (the same batches at every evaluation)."""
    mbs = run.schedule.micro_batch_size
    it = microbatches(dataset, consumed_samples=0, micro_batch_size=mbs, dp_rank=topo.dp_rank,
                      dp=topo.dp, device=topo.device)
    per_step = run.schedule.global_batch_size // (mbs * topo.dp)
    losses = [eval_step(chunks, [next(it) for _ in range(per_step)], topo, shape=shape, dtype=dtype)
              for _ in range(run.logging.eval_iters)]
    return sum(losses) / len(losses)


def _max_over_ranks(value: int, topo) -> int:
    t = torch.tensor([float(value)], device=topo.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
