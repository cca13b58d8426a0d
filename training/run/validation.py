"""Which validation sets a run evaluates, when, and from where in each (Megatron-LM's rules).

- One set, logged as split ``valid``; with --multiple-validation-sets one per prefix of
  --valid-data-path, logged as ``valid-0``, ``valid-1`` ... or ``valid-NAME``
  (--validation-set-names): Megatron-LM's ``validation-0`` / ``validation-NAME`` suffixes. No
  combined loss: Megatron-LM reports none.
- Every --eval-interval iterations, and at the end of training when the last iteration was not
  one of those; --eval-iters 0 evaluates nothing unless --full-validation (Megatron-LM's
  ``do_valid = full_validation or eval_iters > 0``).
- Where an evaluation starts: `validation_consumed`.
"""
from __future__ import annotations

import logging
import math

from megazoo.training.config.run_config import RunConfig

logger = logging.getLogger(__name__)


def validation_sets(run: RunConfig, valid, log: bool = True) -> list[tuple[str, object]]:
    """(log split, dataset) of each validation set: `valid` is None, one dataset, or a list of
    them (--multiple-validation-sets). A set of 0 samples (its documents all shorter than
    --seq-length + 1) is dropped, with one warning (`log`: this rank says it), as Megatron-LM
    runs no evaluation of an empty loader; no set left: evaluation is skipped, said once."""
    if valid is None:
        return []
    if not isinstance(valid, list):
        sets = [("valid", valid)]
    else:
        names = run.logging.validation_set_names or tuple(str(i) for i in range(len(valid)))
        sets = [(f"valid-{name}", ds) for name, ds in zip(names, valid)]
    kept = [(name, ds) for name, ds in sets if len(ds) > 0]
    if log:
        for name, ds in sets:
            if len(ds) == 0:
                logger.warning("validation set %s (%s) holds 0 samples of --seq-length %d + 1 tokens: "
                               "it is not evaluated; give it longer documents or drop it",
                               name, source_of(ds), run.data.seq_length)
        if sets and not kept:
            logger.warning("no validation set holds a sample: evaluation is skipped")
    return kept


def source_of(dataset) -> str:
    """The prefix(es) a validation dataset reads."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None:
        return " + ".join(source_of(d) for d in parts)
    return str(getattr(dataset, "path_prefix", type(dataset).__name__))


def evaluation_due(run: RunConfig, iteration: int, at_end: bool) -> bool:
    """Every --eval-interval iterations (`at_end` False), or at the end of training when the
    last iteration was not one of those (`at_end` True)."""
    interval = run.logging.eval_interval
    if not interval or not iteration or not (run.logging.eval_iters or run.data.full_validation):
        return False
    return bool(iteration % interval) == at_end


def validation_consumed(run: RunConfig, iteration: int) -> int:
    """Where the evaluation at `iteration` starts in the validation set. As Megatron-LM's
    validation iterator, pretraining moves on: the k-th evaluation (at k x --eval-interval, or
    at the end of training after k - 1 of them) reads the k-th run of --eval-iters global
    batches, which the validation set is sized for (training/run/batches.py
    `dataset_num_samples`), so a resumed run continues where the uninterrupted one would be.
    --full-validation reads every set whole from its start (Megatron-LM's full-validation
    loader starts at 0); --sft and --dpo read the same held-out set every time."""
    if run.data.full_validation or run.data.sft or run.dpo is not None:
        return 0
    evaluations_before = (iteration - 1) // run.logging.eval_interval
    return evaluations_before * run.logging.eval_iters * run.schedule.global_batch_size


def describe_full_validation(run: RunConfig, sets: list[tuple[str, object]]) -> None:
    """One line per set (rank 0): how much each whole-set evaluation reads."""
    gbs = run.schedule.global_batch_size
    for name, ds in sets:
        logger.info("--full-validation: each evaluation of %s reads all %d samples (%d global "
                    "batches of %d; --eval-iters not used)", name, len(ds),
                    math.ceil(len(ds) / gbs), gbs)
