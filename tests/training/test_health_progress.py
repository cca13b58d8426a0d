"""Health checks that understand mixed precision: fp16 loss-scaler overflows are not health events,
runs without progress stop with a message under every policy, and samples are left out only when
they fail twice."""
import os

import pytest

import megazoo.training.run.trainer as trainer
from tests.helpers import TINY, one_thread, pretrain_gpt  # noqa: F401 - one_thread: autouse
from megazoo.training.resilience.health import RunHalted
from megazoo.training.monitor.journal import read_jsonl


def test_fp16_rollback_over_200_iterations_never_rolls_back(tmp_path):
    run = pretrain_gpt(TINY + ["--micro-batch-size", "4", "--global-batch-size", "4",
                               "--fp16", "--loss-scale-window", "3", "--hysteresis", "1",
                               "--health-policy", "rollback", "--save", str(tmp_path),
                               "--save-interval", "50", "--train-iters", "200", "--num-layers", "2"], 1)
    assert run.state.iteration == 200
    events = read_jsonl(os.path.join(tmp_path, "journal.jsonl"))
    assert [e for e in events if e["kind"] in ("rollback", "nonfinite", "skip_samples")] == []
    assert run.state.skipped_steps >= 30  # the scaler probed a higher scale every few steps


def _poisoning(monkeypatch, when):
    """forward_backward with NaN gradients whenever `when(call number, microbatches)` says so."""
    real, calls = trainer.forward_backward, []

    def fb(chunks, microbatches, *a, **kw):
        calls.append(microbatches[0]["tokens"].clone())
        kw["poison"] = kw.get("poison") or when(len(calls), microbatches, calls)
        return real(chunks, microbatches, *a, **kw)
    monkeypatch.setattr(trainer, "forward_backward", fb)


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_nan_at_every_step_stops_the_run(tmp_path, monkeypatch, policy):
    _poisoning(monkeypatch, lambda n, mb, calls: n >= 3)
    with pytest.raises(RunHalted, match=r"iteration 7: 5 consecutive steps without an update \(last: "
                                        r"loss is nan\); stopping \(--max-bad-steps 5\)"):
        pretrain_gpt(TINY + ["--train-iters", "50", "--max-bad-steps", "5", "--health-policy", policy], 1)


def test_fp16_skipping_every_step_stops_the_run():
    with pytest.raises(RunHalted, match=r"iteration 20: 20 consecutive steps without an update"):
        pretrain_gpt(TINY + ["--train-iters", "50", "--fp16", "--initial-loss-scale", "1e300"], 1)


def test_samples_are_skipped_only_when_they_fail_twice(tmp_path, monkeypatch):
    bad = []

    def when(n, mb, calls):
        if n == 5:  # iteration 5's first attempt; later, whenever the same samples come back
            bad.append(calls[-1])
        return bool(bad) and any(c.equal(bad[0]) for c in calls[-1:])
    _poisoning(monkeypatch, when)
    run = pretrain_gpt(TINY + ["--train-iters", "8", "--save", str(tmp_path), "--save-interval", "2",
                               "--health-policy", "rollback", "--spike-zscore", "0"], 1)
    assert run.state.iteration == 8
    events = read_jsonl(os.path.join(tmp_path, "journal.jsonl"))
    rollbacks = [(e["iteration"], e["skipped"]) for e in events if e["kind"] == "rollback"]
    assert rollbacks == [(5, False), (5, True)]
    assert [e["ranges"] for e in events if e["kind"] == "skip_samples"] == [[[32, 40]]]


def _frozen_worker(rank, run_dir):
    import signal

    import megazoo.training.checkpoint.format as ckpt
    from tests.helpers import record_hang_start
    real = ckpt.write_rank_file

    def freeze_while_saving(tmp, r, tensors):  # rank 1 freezes writing iteration 3's checkpoint
        if r == 1 and tmp.endswith("iter_0000003.tmp"):
            record_hang_start(run_dir)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(tmp, r, tensors)
    ckpt.write_rank_file = freeze_while_saving
    pretrain_gpt(TINY + ["--train-iters", "5", "--collective-timeout", "3", "--save", run_dir,
                         "--save-interval", "3"], 2)


def test_a_rank_sigstopped_during_a_save_is_named_within_the_timeout(tmp_path):
    from tests.helpers import hang_detail
    detail = hang_detail(_frozen_worker, tmp_path)
    assert "collective checkpoint save (write, agree, commit) over world timed out after 3 s (a " \
           "patient phase) on rank 0: ranks that did not arrive: none (every live rank arrived); " \
           "frozen ranks (no heartbeat for 1.5 s): [1] (rank 1: iteration 3, " in detail, detail
