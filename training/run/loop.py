"""`pretrain`: set up one rank's run (`training/run/trainer.py`), then iterate until done or told to stop.

    trainer = topology, this rank's model chunks, ZeRO optimizer, data, logging (resumed with --load)
    each iteration: step (health policy) -> log window -> evaluate -> tasks -> stop? -> save
    at the end: the final checkpoint, the validation loss (when the last iteration was not
    evaluated; after the save, as Megatron-LM), the run report

Resume is exact: the checkpoint holds the weights, optimizer shards, loss scaler, every rank's
RNG streams, the iteration and the consumed-samples count (the LR and batch-size schedules are
pure functions of those counters). Stopping early (SIGTERM, SIGINT, --exit-interval,
--exit-duration-in-mins) is decided by all ranks together: `training/run/stop.py`.
"""
from __future__ import annotations

import time

from megazoo.training.config.run_config import RunConfig
from megazoo.training.run.stop import LOG_FAILED, StopRequests
from megazoo.training.run.trainer import TrainResult, Trainer, build_chunks

__all__ = ["TrainResult", "build_chunks", "pretrain"]


def pretrain(model_provider, run: RunConfig) -> TrainResult:
    start = time.monotonic()  # --exit-duration-in-mins counts the setup too, as Megatron does
    trainer = Trainer(model_provider, run)  # a setup that fails releases what it took itself
    try:
        with StopRequests(run.schedule.exit_interval, run.schedule.exit_duration_mins, start) as stops:
            stopped = False
            while not trainer.done:
                if not trainer.step():  # rolled back to the last checkpoint
                    continue
                trainer.log_if_due()
                trainer.evaluate_if_due(stops)
                trainer.evaluate_tasks_if_due()
                with trainer.watchdog.collective("all_reduce(stop request)"):
                    signum, why = stops.agreed(trainer.state.iteration, trainer.topo.device,
                                               trainer.journal.failed is not None)
                if why == LOG_FAILED:
                    trainer.log_failed()
                trainer.save_if_due(stopping=bool(why))
                if why:
                    trainer.stop(signum, why)
                    stopped = True
                    break
            trainer.save_final()
            if trainer.done and not stopped:  # as Megatron-LM: after the final save
                trainer.evaluate_if_due(stops, at_end=True)
                with trainer.watchdog.collective("all_reduce(stop request)"):
                    signum, _ = stops.agreed(trainer.state.iteration, trainer.topo.device)
                trainer.result.stop_signal = signum  # a signal during it: its exit code, no report
            trainer.finish()
    finally:
        trainer.close()
    return trainer.result
