"""A stop request during an evaluation: the evaluation ends after its current batch, the stop
checkpoint is written, and nothing slow (the report) runs between it and the exit."""
import logging
import os
import signal

import megazoo.training.run.step as step
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--seed", "5"]


def test_sigterm_during_evaluation_stops_after_the_batch_and_skips_the_report(tmp_path, monkeypatch,
                                                                                caplog):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run.loop import pretrain
    real, batches = step.eval_step, []

    def eval_step(*a, **kw):  # the scheduler's notice arrives during the second batch
        batches.append(1)
        if len(batches) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)
    monkeypatch.setattr(step, "eval_step", eval_step)
    argv = TINY + ["--train-iters", "50", "--eval-interval", "2", "--eval-iters", "40",
                   "--log-interval", "1", "--save", str(tmp_path)]
    with caplog.at_level(logging.INFO):
        result = pretrain(model_provider, to_run_config(build_parser().parse_args(argv), world_size=1))
    assert len(batches) == 2 and result.valid_losses == []
    assert result.stop_signal == signal.SIGTERM and result.state.iteration == 2
    assert result.checkpoint == os.path.join(str(tmp_path), "iter_0000002")
    assert open(os.path.join(tmp_path, "latest")).read().strip() == "iter_0000002"
    assert not os.path.exists(os.path.join(tmp_path, "report.png"))
    assert "evaluation of valid at iteration 2 stopped after 2 of 40 batches: a stop was requested" in caplog.text
    assert f"run report not drawn: stopping on a signal; draw it with tools/report.py {tmp_path}" \
           in caplog.text
