"""--eval-tasks in the training loop: a run that evaluates the tiny local tasks every other
iteration (pp2, dropout on) has the losses and weights of the same run without, bit for bit,
and its scores with the time taken reach metrics.jsonl, TensorBoard and the report."""
from __future__ import annotations

import json
import os

from tests.distributed import run_distributed
from tests.fixtures import GPT2, HERE as FIXTURES
from tests.helpers import TINY, pretrain_gpt

TASKS = [str(FIXTURES / "lm_eval" / "tiny_mc.yaml"), str(FIXTURES / "lm_eval" / "tiny_gen.yaml")]


def _argv():
    argv = list(TINY)
    i = argv.index("--vocab-size")
    del argv[i:i + 2]
    return argv + ["--vocab-file", str(GPT2 / "vocab.json"), "--merge-file", str(GPT2 / "merges.txt"),
                   "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4",
                   "--log-interval", "1", "--pipeline-model-parallel-size", "2"]


def _worker(rank, root):
    import torch
    out = []
    for name, extra in (("plain", []), ("tasks", ["--eval-tasks", *TASKS, "--eval-tasks-interval", "2",
                                                  "--eval-tasks-limit", "3"])):
        result = pretrain_gpt(_argv() + extra + ["--save", os.path.join(root, name)], 2)
        out.append((result.losses, [s for _, s in result.task_scores],
                    torch.get_rng_state().numpy()))
    return out


def test_eval_tasks_change_nothing_and_reach_every_sink(tmp_path):
    (plain, none, rng_plain), (tasks, scores, rng_tasks) = run_distributed(_worker, 2, str(tmp_path),
                                                                           timeout=300)[0]
    assert len(plain) == 4 and plain == tasks  # bit for bit
    assert (rng_plain == rng_tasks).all() and none == []
    assert len(scores) == 2  # iterations 2 and 4
    for s in scores:
        assert {"tiny_mc/acc", "tiny_mc/acc_norm", "tiny_gen/exact_match", "seconds"} <= set(s)
    rows = [json.loads(line) for line in open(tmp_path / "tasks" / "metrics.jsonl")]
    logged = [r for r in rows if r["split"] == "eval_tasks"]
    assert [r["iteration"] for r in logged] == [2, 4] and logged[-1]["tiny_mc/acc"] == scores[-1]["tiny_mc/acc"]
    assert os.path.exists(tmp_path / "tasks" / "report.png")


def test_eval_task_flags_refused_in_one_line(tmp_path):
    import pytest
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    with_tok = _argv()[:-2]  # no pp: one process
    cases = [(with_tok + ["--eval-tasks", str(tmp_path / "nope.yaml")], "no such task file"),
             (with_tok + ["--eval-tasks-interval", "5"], "without --eval-tasks"),
             (list(TINY) + ["--train-iters", "2", "--eval-tasks", TASKS[0]], "needs the run's tokenizer"),
             (with_tok + ["--eval-tasks", TASKS[0], "--eval-tasks-interval", "-1"], ">= 0"),
             (with_tok + ["--eval-tasks", TASKS[0], "--context-parallel-size", "2"],
              "--context-parallel-size 1")]
    for argv, words in cases:
        with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace("-", r"\-")):
            to_run_config(build_parser().parse_args(argv), world_size=2)
    run = to_run_config(build_parser().parse_args(with_tok + ["--eval-tasks", *TASKS]), world_size=1)
    assert run.logging.eval_tasks == tuple(TASKS) and run.logging.eval_tasks_interval == 0
