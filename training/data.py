"""From the data configuration to per-rank microbatches of tokens and labels.

Every rank reads its own microbatches (the datasets are memory-mapped, the sampler is
deterministic), so no broadcast of data across TP or PP ranks is needed. Under context
parallelism a rank keeps only its chunks of each sample's tokens and labels
(`parallel.context_parallel.split_sequence`); the model derives their positions from its rank.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from data.blended import build_train_valid_test_datasets
from data.samplers import PretrainingSampler
from parallel.context_parallel import split_sequence

from .config import DataConfig
from .health import SkippingDataset, merge_ranges


class MockGPTDataset:
    """Deterministic synthetic samples (--mock-data): a noisy repeating pattern that is learnable."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.n, self.seq, self.vocab, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng(self.seed * 1_000_003 + idx)
        period = int(rng.integers(2, 9))
        pattern = rng.integers(0, self.vocab, size=period)
        tokens = np.resize(pattern, self.seq + 1)
        return {"tokens": tokens.astype(np.int64)}


def build_datasets(cfg: DataConfig, *, seed: int, vocab_size: int, num_samples: tuple[int, int, int]):
    """(train, valid, test); valid/test may be None."""
    if cfg.mock_data:
        return tuple(MockGPTDataset(max(n, 1), cfg.seq_length, vocab_size, seed + i)
                     for i, n in enumerate(num_samples))
    return build_train_valid_test_datasets(cfg.data_path, cfg.split, cfg.seq_length, seed,
                                           num_samples, cfg.data_cache_path)


def microbatches(dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp: int,
                 device: torch.device, cp: int = 1, cp_rank: int = 0) -> Iterator[dict]:
    """Endless stream of {"tokens": [b, s/cp], "labels": [b, s/cp]} for this DP rank (this
    context rank's chunks of the sequence), from `consumed`."""
    total = len(dataset)
    while True:
        sampler = PretrainingSampler(total, consumed_samples % total, micro_batch_size, dp_rank, dp)
        for indices in sampler:
            sample = np.stack([np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in indices])
            t = torch.from_numpy(sample)
            yield {k: split_sequence(x, 1, cp, cp_rank).to(device)
                   for k, x in (("tokens", t[:, :-1]), ("labels", t[:, 1:]))}
        consumed_samples = 0  # wrapped around the dataset: start another pass


class TrainData:
    """The training stream: a dataset view without skipped samples, read from a consumed count."""

    def __init__(self, dataset, skip, *, micro_batch_size: int, dp_rank: int, dp: int, device,
                 cp: int = 1, cp_rank: int = 0):
        self.base, self.mbs, self.dp_rank, self.dp, self.device = dataset, micro_batch_size, dp_rank, dp, device
        self.cp, self.cp_rank = cp, cp_rank
        self.view = SkippingDataset(dataset, list(skip))
        self._it = None

    def restart(self, consumed_samples: int) -> None:
        self._it = microbatches(self.view, consumed_samples=consumed_samples, micro_batch_size=self.mbs,
                                dp_rank=self.dp_rank, dp=self.dp, device=self.device, cp=self.cp,
                                cp_rank=self.cp_rank)

    def next_global_batch(self, batch: int) -> list[dict]:
        return [next(self._it) for _ in range(batch // (self.mbs * self.dp))]

    def physical_ranges(self, consumed_samples: int, batch: int) -> list[tuple[int, int]]:
        """Dataset sample ranges behind the global batch that starts at `consumed_samples`."""
        n = len(self.view)
        return merge_ranges([(p, p + 1) for p in (self.view.physical((consumed_samples + i) % n)
                                                   for i in range(batch))])

    def skip(self, ranges: list[tuple[int, int]]) -> None:
        self.view = SkippingDataset(self.base, self.view.skip + list(ranges))
