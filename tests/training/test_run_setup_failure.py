"""A run whose setup fails part way releases what it already took (the --save lock, the journal)
before the error reaches the caller, which never got a trainer to close."""
import pytest

from megazoo.training.checkpoint.storage import SaveLock
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--mock-data", "--vocab-size", "31",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]


def test_failed_setup_releases_the_save_lock(tmp_path, monkeypatch):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run import trainer
    from megazoo.training.run.loop import pretrain

    def no_data(*args, **kwargs):
        raise RuntimeError("no data today")

    monkeypatch.setattr(trainer, "build_datasets", no_data)  # after the lock and the journal
    run = to_run_config(build_parser().parse_args(TINY + ["--save", str(tmp_path)]), world_size=1)
    with pytest.raises(RuntimeError, match="no data today") as failed:
        pretrain(model_provider, run)
    # The traceback (kept alive by `failed`) still references the half-built trainer, so only
    # an explicit release lets a second holder in.
    SaveLock(str(tmp_path)).release()
    assert failed.value is not None
