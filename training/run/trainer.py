"""One rank's run: what `pretrain` sets up (topology, chunks, optimizer, data, logging) and the
pieces of an iteration it calls in order: a step under the health policy, the log window, the
evaluation, the checkpoint."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from megazoo.models.lora import apply_lora
from megazoo.models.moe import update_expert_biases
from megazoo.parallel import collectives as C
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from megazoo.parallel.random import model_parallel_seed
from megazoo.parallel.topology import initialize
from megazoo.parallel.zero.optimizer import build_optimizer

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.async_writer import AsyncCheckpointWriter
from megazoo.training.checkpoint import storage
from megazoo.training.checkpoint.tokenizer import store_training_tokenizer
from megazoo.training.config.run_config import RunConfig
from megazoo.training.run.batches import TrainData, build_datasets, dataset_num_samples, document_flags
from megazoo.training.run.compile import compile_layers, report_graph_breaks
from megazoo.training.resilience.faults import maybe_hang, report_unhealthy, roll_back
from megazoo.training.resilience.health import HealthMonitor, ProgressGuard, after_step
from megazoo.training.monitor.journal import LogWriteError, RunJournal
from megazoo.training.monitor.console import Progress, RunLogger
from megazoo.training.run.dpo import PreferenceStats, build_reference, make_dpo_forward_fn
from megazoo.training.run.grpo_train import GRPOTraining
from megazoo.training.run.lr_schedule import global_batch_size, learning_rate
from megazoo.training.monitor.metrics import device_peak_flops, moe_metrics, mtp_metrics
from megazoo.training.planning.planner import Layout, PlanError, memory_per_gpu
from megazoo.training.monitor.report import write_report
from megazoo.training.checkpoint.resume import load
from megazoo.training.checkpoint.save import TrainState, layout_of, save
from megazoo.training.run.step import activation_shape, evaluate, forward_backward
from megazoo.training.run.validation import (describe_full_validation, evaluation_due, validation_consumed,
                                             validation_sets)
from megazoo.training.resilience.watchdog import CollectiveWatchdog, backend_timeout
from megazoo.training.monitor.window import LogWindow

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float]  # training loss of every iteration run in this process
    valid_losses: list[tuple[int, float]]
    checkpoint: str | None
    stop_signal: int = 0  # SIGTERM or SIGINT that stopped the run early (0: none)
    task_scores: list[tuple[int, dict]] = dataclasses.field(default_factory=list)  # --eval-tasks
    dpo: list[dict] = dataclasses.field(default_factory=list)  # --dpo: each step's rewards etc.
    grpo: list[dict] = dataclasses.field(default_factory=list)  # --grpo-prompts: each step's metrics
    valid_dpo: list[tuple[int, dict]] = dataclasses.field(default_factory=list)  # and held out
    # --multiple-validation-sets: (iteration, split name as logged, loss) of each set
    valid_sets: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)


def build_chunks(model_provider, run: RunConfig, topo, rng):
    specs = topo.config.chunk_specs(run.model.num_layers, topo.pp_rank)
    chunks = [model_provider(run.model, topo, rng=rng, **spec.kwargs()) for spec in specs]
    if topo.pp > 1:
        broadcast_tied_embedding(chunks, topo)
    if run.lora is not None:  # before the optimizer: it holds the adapters only
        apply_lora(chunks, run.lora, run.model, topo, rng, run.seed)
    return chunks


def predicted_memory(run: RunConfig, dp: int) -> str:
    """What the planner expects this run to hold per rank (a check on both: see docs/planner.md)."""
    try:
        mem = memory_per_gpu(run.model, Layout.of_run(run, dp))
    except (PlanError, ValueError) as e:  # a layout the planner does not model
        return f"not modelled ({e})"
    gib = 2 ** 30
    return (f"weights {mem.params / gib:.3f} GiB, gradients {mem.grads / gib:.3f} GiB, optimizer "
            f"{mem.optimizer / gib:.3f} GiB, activations {mem.activations / gib:.3f} GiB "
            f"({mem.stage} stage)")


class Trainer:
    def __init__(self, model_provider, run: RunConfig):
        # What close() releases, in case the setup fails part way (the caller has no trainer yet).
        self.lock = self.data = self.log = self.watchdog = self.writer = None
        try:
            self._set_up(model_provider, run)
        except BaseException:
            self.close()
            raise

    def _set_up(self, model_provider, run: RunConfig) -> None:
        self.run, self.sched = run, run.schedule
        self.topo = topo = initialize(run.parallel,
                                      timeout_s=backend_timeout(run.health.collective_timeout))
        self.rng = model_parallel_seed(run.seed, topo)
        self.chunks = build_chunks(model_provider, run, topo, self.rng)
        self.graph_breaks: dict[str, int] = {}  # per compiled layer, after the first step
        self.compiled = compile_layers(self.chunks, run.compile_backend) \
            if run.compile_backend else None  # reported after the first step: report_graph_breaks
        self.opt = build_optimizer(self.chunks, topo, run.optimizer, run.model.dtype)
        self.lock = storage.SaveLock(run.checkpoint.save) \
            if run.checkpoint.save and topo.rank == 0 else None
        if self.lock is not None:  # only the job holding --save writes there, the tokenizer first
            store_training_tokenizer(run.data, run.checkpoint)
        self.writer = AsyncCheckpointWriter(topo.rank, topo.world_size, topo.device) \
            if run.checkpoint.async_save else None
        self.journal = journal = RunJournal(run.run_dir)
        self.watchdog = CollectiveWatchdog(
            run.health.collective_timeout, topo.rank, topo.world_size,
            on_timeout=lambda msg: journal.event("hang", rank=topo.rank, detail=msg))
        mcfg, seq, gbs = run.model, run.data.seq_length, self.sched.global_batch_size
        try:  # watched: a rank frozen while the others wait is named (patient: one may work long)
            self.state = TrainState()
            if run.checkpoint.load:
                with self.watchdog.collective("checkpoint load (read, verify, agree)", patient=True):
                    self.state = load(run, topo, self.chunks, self.opt, self.rng)
            self.grpo, self.valid_ds = None, None
            if run.grpo is not None:  # samples its own batches: no dataset
                self.grpo = GRPOTraining(run, topo, self.chunks, model_provider)
            else:
                with self.watchdog.collective("data index build (rank 0 builds, the others wait)",
                                              patient=True):
                    train_ds, self.valid_ds, _ = build_datasets(
                        run.data, seed=run.seed, vocab_size=mcfg.vocab_size,
                        num_samples=dataset_num_samples(self.sched.train_iters, self.sched.train_samples, gbs,
                                                        run.logging.eval_interval, run.logging.eval_iters,
                                                        run.data.full_validation))
        except BaseException:
            self.watchdog.close()  # no beats from a run that never started
            raise
        self.valid_sets = validation_sets(run, self.valid_ds, log=topo.rank == 0)
        if run.data.full_validation and topo.rank == 0:
            describe_full_validation(run, self.valid_sets)
        if self.grpo is None:
            self.data = TrainData(train_ds, journal.skipped_samples(),
                                  micro_batch_size=self.sched.micro_batch_size, dp_rank=topo.dp_rank,
                                  dp=topo.dp, device=topo.device, num_workers=run.data.num_workers,
                                  eod_mask_token=run.data.eod_mask_token, cp=topo.cp, cp_rank=topo.cp_rank,
                                  documents=document_flags(run.data), pad_mask_token=run.data.pad_mask_token)
            self.data.restart(self.state.consumed_samples)
        self.dpo_forward = self.dpo_eval_forward = None
        self.dpo_stats, self.dpo_eval_stats = PreferenceStats(), PreferenceStats()
        if run.dpo is not None:
            reference = build_reference(run, topo, self.chunks, model_provider)
            self.dpo_forward = lambda scale, poison: make_dpo_forward_fn(
                run.dpo, reference, self.dpo_stats, scale, poison)
            self.dpo_eval_forward = lambda scale, poison: make_dpo_forward_fn(
                run.dpo, reference, self.dpo_eval_stats, scale, poison)
        self.shape = activation_shape(topo, seq, self.sched.micro_batch_size, mcfg.hidden_size)
        peak, peak_source = device_peak_flops(topo.device, run.logging.peak_flops, run.model.params_dtype)
        self.window = LogWindow(mcfg.model_flops_per_token(seq), peak, topo, self.state.iteration + 1)
        self.log = RunLogger(run.logging, {"run": dataclasses.asdict(run)}, topo.rank == 0, journal,
                             self.state.iteration,
                             Progress(self.sched.train_iters, self.state.iteration, seq))
        if topo.rank == 0:
            active = f" ({mcfg.num_parameters(active=True) / 1e6:.2f}M active per token)" \
                if mcfg.num_experts else ""
            logger.info("model: %.2fM parameters%s; layout %s; %s", mcfg.num_parameters() / 1e6,
                        active, layout_of(run, topo), f"peak {peak:.3g} FLOP/s per rank ({peak_source})" if peak
                        else peak_source)
            logger.info("memory per rank (bytes): %s", self.opt.memory_report())
            logger.info("planner's prediction for the heaviest rank: %s", predicted_memory(run, topo.dp))
        self.monitor, self.guard = HealthMonitor(run.health), ProgressGuard(run.health)
        self.tasks = None
        if run.logging.eval_tasks:  # lm-evaluation-harness is imported only when asked for
            from megazoo.training.evaluation.during_training import TaskEvaluator
            self.tasks = TaskEvaluator(run, self.chunks, topo)
        self.nan_injected = False
        self.last_step, self.batch = None, 0
        self.result = TrainResult(self.state, [], [], None)
        self.checkpoints: list[str] = []  # written by this run, for the closing summary

    @property
    def done(self) -> bool:
        return self.state.iteration >= self.sched.train_iters

    def step(self) -> bool:
        """One optimizer step under the health policy; False when it rolled back instead."""
        run, topo, opt, state, health = self.run, self.topo, self.opt, self.state, self.run.health
        it = state.iteration + 1  # the iteration this step makes
        self.watchdog.at_iteration(it)
        step_begin, timings = time.perf_counter(), {}
        batch = global_batch_size(self.sched, state.consumed_samples)
        microbatch_list = self.data.next_global_batch(batch) if self.grpo is None else None
        opt.lr = learning_rate(self.sched, state.iteration)
        maybe_hang(health, topo.rank, it)
        poison = health.inject_nan_at == it and not self.nan_injected
        self.nan_injected |= poison
        start = time.perf_counter()
        if self.grpo is not None:
            with self.watchdog.collective("GRPO sampling and forward/backward (tensor- and "
                                          "data-parallel collectives)"):
                loss = self.grpo.forward_backward(it, opt, poison)
            timings["ready"] = time.perf_counter()
        else:
            loss = forward_backward(self.chunks, microbatch_list, topo, opt,
                                    schedule=self.sched.pipeline_schedule, shape=self.shape,
                                    watchdog=self.watchdog, poison=poison, timings=timings,
                                    per_token_loss=run.data.per_token_loss, forward_fn=self.dpo_forward)
        verdict, step = self.monitor.check(loss), None
        if verdict.healthy or health.policy == "warn":
            with self.watchdog.collective("optimizer step (dp reduce, grad norm, all-gather)"):
                step = opt.step(loss=loss)
            verdict = after_step(verdict, step.skipped, step.reason, opt.scaler.dynamic)
        else:  # skip / rollback: drop this step's update
            opt.grad_sync.finish()
        if run.model.num_experts and run.model.moe_router_enable_expert_bias:
            # after every step, as Megatron-LM (the load was observed whether or not it stepped)
            with self.watchdog.collective("expert bias update (load all-reduce)"):
                update_expert_biases(self.chunks, run.model.num_layers, topo.device)
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        self.guard.count(step is not None and not step.skipped, it,
                         verdict.detail or (step.reason if step else ""))
        if not verdict.healthy:
            samples = self.data.physical_ranges(state.consumed_samples, batch) if self.data else []
            report_unhealthy(self.journal, topo, it, verdict, samples, health.policy)
            if health.policy == "rollback":
                if self.writer is not None:  # roll back to the newest checkpoint, committed
                    self.writer.wait()
                skip = self.guard.roll_back(it, samples)
                with self.watchdog.collective("rollback (checkpoint load)", patient=True):
                    self.state = self.result.state = roll_back(run, topo, self.chunks, opt, self.rng,
                                                               self.data, self.journal, it, samples, skip)
                return False
        else:
            self.monitor.record_healthy(loss)
        state.iteration += 1
        state.consumed_samples += batch
        state.skipped_steps += int(step is None or step.skipped)
        self.result.losses.append(loss)
        if run.dpo is not None:
            with self.watchdog.collective("DPO metrics all-reduce"):
                self.result.dpo.append(self.dpo_stats.reduce(topo))
        if self.grpo is not None:
            self.result.grpo.append(self.grpo.history[-1])
        self.window.add(loss, batch * run.data.seq_length, elapsed, timings["ready"] - step_begin,
                        time.perf_counter() - step_begin)
        self.last_step, self.batch = step, batch
        if self.compiled is not None:  # the first step compiled the layers: say what broke, once
            self.graph_breaks = self.compiled.breaks()
            report_graph_breaks(self.journal, topo.rank, self.compiled)
            self.compiled = None
        return True

    def log_if_due(self) -> None:
        """Every --log-interval iterations (and at the last): the window's metrics, then stragglers."""
        it = self.state.iteration
        if it % self.run.logging.log_interval == 0 or it == self.sched.train_iters:
            self.log_window()

    def log_window(self) -> None:
        it = self.state.iteration
        with self.watchdog.collective("log window (metrics all-reduce, straggler all-gather)"):
            moe_summary, moe_layers = moe_metrics(self.chunks, self.run.model.num_layers,
                                                  self.topo.device)
            self.log.log({**self.window.metrics(self.opt, self.last_step, self.state, self.batch),
                          **moe_summary, **mtp_metrics(self.chunks, self.topo.device)}, it)
            if moe_layers:
                self.log.log(moe_layers, it, "moe")
            if self.run.dpo is not None and self.window.n:  # the window's steps' mean
                recent = self.result.dpo[-self.window.n:]
                self.log.log({k: sum(d[k] for d in recent) / len(recent) for k in recent[0]}, it, "dpo")
            if self.grpo is not None and self.window.n:  # the window's steps' mean (max: max)
                recent = self.result.grpo[-self.window.n:]
                self.log.log({k: (max(d[k] for d in recent) if k.endswith("_max") else
                                  sum(d[k] for d in recent) / len(recent)) for k in recent[0]}, it, "grpo")
            self.window.check_stragglers(self.run.health.straggler_threshold, self.journal, it)
        self.window.reset()

    def evaluate_if_due(self, stops=None, at_end: bool = False) -> None:
        """Each validation set (training/run/validation.py) every --eval-interval iterations, and
        `at_end` of training when the last iteration was not one of those (Megatron-LM evaluates
        at the end of training too); a stop request (`stops`: the run's StopRequests) ends the
        evaluation after its current batch, and nothing of that set (nor of the sets after it)
        is logged."""
        it = self.state.iteration
        if not self.valid_sets or not evaluation_due(self.run, it, at_end):
            return
        interrupted = (lambda: stops.signalled(self.topo.device) != 0) if stops is not None else None
        for name, dataset in self.valid_sets:
            vloss, batches, planned = evaluate(self.chunks, dataset, self.topo, self.run,
                                               self.shape, self.opt.dtype,
                                               watchdog=self.watchdog, interrupted=interrupted,
                                               forward_fn=self.dpo_eval_forward,
                                               consumed_samples=validation_consumed(self.run, it))
            dpo = {}
            if self.run.dpo is not None:  # the held-out pairs' rewards (collective)
                with self.watchdog.collective("DPO evaluation metrics all-reduce"):
                    dpo = self.dpo_eval_stats.reduce(self.topo)
            if batches < planned:
                if self.topo.rank == 0:
                    logger.warning("evaluation of %s at iteration %d stopped after %d of %d batches: "
                                   "a stop was requested", name, it, batches, planned)
                return
            if name == "valid":
                self.result.valid_losses.append((it, vloss))
            else:
                self.result.valid_sets.append((it, name, vloss))
            if dpo:
                self.result.valid_dpo.append((it, dpo))
            self.log.log(dict(loss=vloss, **dpo) if dpo else dict(loss=vloss, ppl=math.exp(min(vloss, 50))),
                         it, name)

    def evaluate_tasks_if_due(self) -> None:
        """--eval-tasks every --eval-tasks-interval iterations and after the last: the scores
        and the seconds it took, logged as split "eval_tasks" in every sink."""
        if self.tasks is None or not self.tasks.due(self.state.iteration):
            return
        with self.watchdog.collective("lm-eval tasks (forward passes of the layout)", patient=True):
            scores = self.tasks.evaluate()
        self.result.task_scores.append((self.state.iteration, scores))
        self.log.log(scores, self.state.iteration, "eval_tasks")

    def save_if_due(self, stopping: bool) -> None:
        """Every --save-interval iterations, and when the run stops early (--async-save: first
        commits the background save in flight once every rank has written it)."""
        if self.writer is not None and self.writer.in_flight is not None:
            # an all-reduce, then (once written) the commit's agreements: watched; not patient,
            # since nobody writes inside (rank 0 only renames) and a patient phase beats the store
            with self.watchdog.collective("checkpoint commit poll (agree, commit once written)"):
                self.writer.poll()
        interval = self.run.checkpoint.save_interval
        if self.run.checkpoint.save and (stopping or (interval and self.state.iteration % interval == 0)):
            self.save_now()

    def save_now(self) -> None:
        """Collective: checkpoint this iteration (in the background with --async-save), watched: a
        rank frozen while the others wait is named (the writing ranks are alive, so a slow write is
        waited for: a patient phase)."""
        with self.watchdog.collective("checkpoint save (write, agree, commit)", patient=True):
            self.result.checkpoint = save(self.run, self.topo, self.chunks, self.opt, self.rng,
                                          self.state, self.writer)
        self.checkpoints.append(self.result.checkpoint)

    def stop(self, signum: int, why: str) -> None:
        """Stopping early: the steps since the last log line are logged, then the reason."""
        if self.window.n:
            self.log_window()
        self.result.stop_signal = signum
        if self.topo.rank == 0:
            logger.warning("%s: stopping at iteration %d%s", why, self.state.iteration,
                           ", checkpoint written" if self.run.checkpoint.save else "")

    def save_final(self) -> None:
        """The final state saved (unless just saved) and on disk."""
        save_dir = self.run.checkpoint.save
        if save_dir and self.result.checkpoint != ckpt.iteration_dir(save_dir, self.state.iteration):
            self.save_now()
        if self.writer is not None:
            with self.watchdog.collective("checkpoint write in the background (wait, commit)",
                                          patient=True):
                self.writer.wait()

    def finish(self) -> None:
        """The run report (not after a stop signal: the scheduler's grace period is for the
        checkpoint, and drawing takes seconds), the summary."""
        save_dir = self.run.checkpoint.save
        if self.topo.rank == 0 and self.run.run_dir and self.result.stop_signal:
            logger.info("run report not drawn: stopping on a signal; draw it with "
                        "tools/report.py %s", self.run.run_dir)
        elif self.topo.rank == 0 and self.run.run_dir:
            try:
                logger.info("run report: %s", write_report(self.run.run_dir))
            except FileNotFoundError as e:  # no iteration logged in this folder yet
                logger.info("no run report: %s", e)
        self.log.summary(self.state.iteration, self.state.consumed_samples, self.checkpoints, save_dir)
        with self.watchdog.collective("all_reduce(run log written)"):
            t = torch.tensor([float(self.journal.failed is not None)], device=self.topo.device)
            C.all_reduce(t, C.world(), op=C.ReduceOp.MAX)
        if t.item():
            self.log_failed()

    def log_failed(self) -> None:
        """A rank could not write the run log (a full disk): every rank stops here, the rank that
        failed with its one line (training/run/entry.py); nothing more is written."""
        failed = self.journal.failed
        raise LogWriteError(failed or "another rank could not write the run log", failed is not None)

    def close(self) -> None:
        if self.writer is not None:  # a run that failed: a save in flight is not committed
            self.writer.abandon()
        for part in (self.data, self.log, self.watchdog):
            if part is not None:
                part.close()
        if self.lock is not None:
            self.lock.release()
