"""A validation split of zero documents skips evaluation with a warning that says how to get one;
with --eval-iters 0 (no evaluation asked) nothing is said."""
import logging

import numpy as np

from megazoo.data.indexed import IndexedDatasetBuilder
from megazoo.training.config.run_config import DataConfig
from megazoo.training.run.batches import build_datasets


def test_empty_validation_split_is_said(tmp_path, caplog):
    prefix = str(tmp_path / "three_docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in (30, 40, 50):
        builder.add_document(np.arange(n, dtype=np.int32) % 100)
    builder.finalize(prefix + ".idx")
    cfg = DataConfig(data_path=[prefix], split="969,30,1", seq_length=4,
                     data_cache_path=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="megazoo.training.run.batches"):
        train, valid, _ = build_datasets(cfg, seed=1, vocab_size=100, num_samples=(8, 4, 0))
        assert train is not None and valid is None
        assert [r.getMessage() for r in caplog.records if "evaluation is skipped" in r.getMessage()]
        caplog.clear()
        build_datasets(cfg, seed=1, vocab_size=100, num_samples=(8, 0, 0))  # --eval-iters 0
    assert not caplog.records
