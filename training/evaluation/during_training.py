"""--eval-tasks in the training loop: lm-evaluation-harness tasks on the run's own chunks and
layout, every --eval-tasks-interval iterations (and after the last one).

Every rank takes part (each forward pass is a collective of the layout; data-parallel replicas
compute the same numbers). Evaluating changes nothing of the run: the models are scored in eval
mode (no dropout, no MoE statistics), the random states lm_eval seeds are restored
(`tasks.preserved_random_state`), and the data iterator is not touched, so the following steps
are bit for bit those of a run without --eval-tasks.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def run_tokenizer(data, vocab_size: int):
    """The tokenizer the run trains with (the one its data was made with)."""
    from megazoo.data.tokenizers import build_tokenizer
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file,
                           merge_file=data.merge_file, tokenizer_model=data.tokenizer_model,
                           vocab_size=vocab_size)


class TaskEvaluator:
    def __init__(self, run, chunks, topo):
        from megazoo.training.evaluation.harness import MegazooLM
        from megazoo.training.evaluation.tasks import check_task_specs, task_manager
        cfg = run.logging
        self.specs, self.interval, self.limit = list(cfg.eval_tasks), cfg.eval_tasks_interval, \
            cfg.eval_tasks_limit
        self.train_iters, self.device = run.schedule.train_iters, topo.device
        check_task_specs(self.specs)
        tok = run_tokenizer(run.data, run.model.vocab_size)
        eos = [run.data.eod_token] if run.data.eod_token is not None else [tok.eod]
        self.lm = MegazooLM.of_chunks(chunks, topo, tok, eos, batch_size=cfg.eval_tasks_batch_size)
        self.manager = task_manager(self.specs)

    def due(self, iteration: int) -> bool:
        return iteration == self.train_iters or bool(self.interval and iteration % self.interval == 0)

    def evaluate(self) -> dict:
        """{"task/metric": score, ..., "seconds": time taken} (scores on the reporting rank)."""
        from megazoo.training.evaluation.tasks import evaluate_tasks
        scores, seconds = evaluate_tasks(self.lm, self.specs, self.manager, self.limit, self.device)
        return {**scores, "seconds": seconds}
