"""Data-parallel batch sampler that resumes from a consumed-samples count (Megatron's semantics)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass
class PretrainingSampler:
    """Walks samples ``consumed_samples, consumed_samples + 1, ...`` in global batches of
    ``micro_batch_size * dp_size``; each rank yields its own contiguous slice of every global
    micro batch. Resuming with the saved consumed count continues exactly where training stopped.
    """

    total_samples: int
    consumed_samples: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {self.total_samples}")
        if self.consumed_samples >= self.total_samples:
            raise ValueError(f"no samples left: consumed {self.consumed_samples} of {self.total_samples}")
        if self.micro_batch_size <= 0 or self.dp_size <= 0:
            raise ValueError("micro_batch_size and dp_size must be positive")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} not in [0, {self.dp_size})")

    def __len__(self) -> int:
        return self.total_samples

    def _my_slice(self, batch: list[int]) -> list[int]:
        start = self.dp_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        global_size = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while start + global_size <= self.total_samples:
            yield self._my_slice(list(range(start, start + global_size)))
            start += global_size
        if start < self.total_samples and not self.drop_last:
            yield self._my_slice(list(range(start, self.total_samples)))
