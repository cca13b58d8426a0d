"""Operations: spike/NaN detection, rollback that skips the bad samples, the collective watchdog,
straggler reports, the run report and checkpoint inspection."""
import json
import math
import os
import time

from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.helpers import TINY, hang_detail, pretrain_gpt, record_hang_start
from tests.tool_runs import tool_output
from megazoo.training.config.run_config import HealthConfig
from megazoo.training.resilience.health import HealthMonitor
from megazoo.training.run.batches import SkippingDataset, merge_ranges
from megazoo.training.monitor.journal import read_jsonl


def test_monitor_flags_nonfinite_and_spikes():
    m = HealthMonitor(HealthConfig(spike_zscore=6.0, spike_window=20))
    assert m.check(float("nan")).kind == "nonfinite"
    for i in range(20):
        loss = 3.0 - 0.01 * i + 0.02 * math.sin(i)
        assert m.check(loss).healthy
        m.record_healthy(loss)
    assert m.check(2.9).healthy
    v = m.check(5.0)
    assert v.kind == "spike" and "z-score" in v.detail


def test_skipping_dataset_maps_logical_to_physical():
    assert merge_ranges([(5, 6), (2, 4), (3, 5)]) == [(2, 6)]
    view = SkippingDataset(list(range(10)), [(2, 4), (5, 6)])
    assert len(view) == 7
    assert [view[i] for i in range(7)] == [0, 1, 4, 6, 7, 8, 9]


ROLLBACK = TINY + ["--train-iters", "8", "--save-interval", "2", "--spike-zscore", "0"]


def _rollback_worker(rank, bad_dir, ref_dir):
    a = pretrain_gpt(ROLLBACK + ["--save", bad_dir, "--health-policy", "rollback",
                                 "--inject-nan-at-iteration", "5"], 2)
    b = pretrain_gpt(ROLLBACK + ["--save", ref_dir], 2)
    return a.losses, b.losses, a.state.iteration


def test_nan_rollback_replays_and_equals_a_run_without_the_fault(tmp_path):
    """A one-off NaN: the rollback replays the same samples (nothing is skipped the first time)
    and the run ends bitwise equal to one that never had the fault."""
    bad, ref = str(tmp_path / "bad"), str(tmp_path / "ref")
    losses_a, losses_b, it = run_distributed(_rollback_worker, 2, bad, ref, timeout=300)[0]
    assert it == 8
    events = read_jsonl(os.path.join(bad, "journal.jsonl"))
    kinds = [e["kind"] for e in events]
    assert "nonfinite" in kinds and "rollback" in kinds and "skip_samples" not in kinds
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert rollback["iteration"] == 5 and rollback["to_iteration"] == 4
    assert rollback["samples"] == [[32, 40]] and rollback["skipped"] is False
    assert losses_a[-4:] == losses_b[-4:]
    for r in range(2):
        wa = load_file(os.path.join(bad, "iter_0000008", f"rank_{r:05d}.safetensors"))
        wb = load_file(os.path.join(ref, "iter_0000008", f"rank_{r:05d}.safetensors"))
        for k in wa:
            if k.startswith("model."):
                assert (wa[k] == wb[k]).all(), k
    assert os.path.getsize(os.path.join(bad, "report.png")) > 10_000


def _hang_worker(rank, run_dir):
    import megazoo.training.run.trainer as trainer
    real = trainer.maybe_hang

    def recorded(cfg, r, iteration):
        if list(cfg.inject_hang[:2]) == [r, iteration]:
            record_hang_start(run_dir)
        real(cfg, r, iteration)
    trainer.maybe_hang = recorded
    pretrain_gpt(TINY + ["--train-iters", "5", "--collective-timeout", "3", "--inject-hang", "1", "3", "60",
                         "--tensorboard-dir", run_dir], 2)



def test_hung_collective_ends_the_job_naming_the_rank(tmp_path):
    detail = hang_detail(_hang_worker, tmp_path)
    assert "all_reduce(loss) over world timed out after 3 s" in detail
    assert "ranks that did not arrive: [1]" in detail


def test_inspect_checkpoint_verifies_and_flags_truncation(tmp_path):
    run_distributed(_save_worker, 2, str(tmp_path), timeout=120)
    rc, out, err = tool_output("inspect_checkpoint", tmp_path)
    assert rc == 0, err
    assert "iteration 2" in out and "tp=1 pp=1 dp=2" in out and "all 2 shards readable" in out
    shard = os.path.join(tmp_path, "iter_0000002", "rank_00001.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    rc, out, err = tool_output("inspect_checkpoint", tmp_path)
    assert rc == 1
    assert "rank_00001.safetensors" in out + err and "truncated" in out + err


def _save_worker(rank, root):
    pretrain_gpt(TINY + ["--train-iters", "2", "--save", root], 2)


def _straggler_worker(rank, run_dir):
    pretrain_gpt(TINY + ["--train-iters", "4", "--log-interval", "2", "--inject-hang", "1", "3", "1.0",
                         "--tensorboard-dir", run_dir], 2)


def test_slow_rank_is_named(tmp_path):
    run_distributed(_straggler_worker, 2, str(tmp_path), timeout=120)
    events = [e for e in read_jsonl(os.path.join(tmp_path, "journal.jsonl")) if e["kind"] == "straggler"]
    assert [(e["iteration"], e["ranks"]) for e in events] == [(4, [1])]
    assert events[0]["times"][1] > 1.0 > events[0]["times"][0]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))  # TensorBoard
