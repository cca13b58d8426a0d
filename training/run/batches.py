"""From the data configuration to per-rank microbatches of tokens and labels.

Every rank reads its own microbatches (the datasets are memory-mapped, the sampler is
deterministic), so no broadcast of data across TP or PP ranks is needed. Under context
parallelism a rank keeps only its chunks of each sample's tokens and labels
(`parallel.context_split.split_sequence`); the model derives their positions from its rank.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from megazoo.data.blended import build_train_valid_test_datasets
from megazoo.data.indexed import IndexedDatasetError
from megazoo.data.per_split import build_per_split_datasets
from megazoo.data.packing import documents_after_eod, positions_in_documents
from megazoo.data.samplers import PretrainingSampler
from megazoo.data.preference import split_preference_datasets
from megazoo.data.sft_dataset import split_sft_datasets
from megazoo.parallel import collectives as C
from megazoo.parallel.context_split import split_sequence

from megazoo.training.config.run_config import DataConfig

logger = logging.getLogger(__name__)


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


def dataset_num_samples(train_iters: int, train_samples: int | None, global_batch_size: int,
                        eval_interval: int, eval_iters: int,
                        full_validation: bool = False) -> tuple[int, int | None, int]:
    """Samples asked of the (train, valid, test) datasets, as Megatron-LM's training asks for
    them (training.py get_train_valid_test_num_samples): --train-samples itself, else
    train_iters x gbs; (train_iters // eval_interval + 1) x eval_iters x gbs for validation, or
    None with --full-validation (the split read whole: one epoch). Test: 0, megazoo never
    evaluates on it (Megatron builds eval_iters x gbs; the other splits do not depend on it)."""
    train = train_samples or train_iters * global_batch_size
    if full_validation:
        return train, None, 0
    evals = train_iters // max(eval_interval, 1) + 1
    return train, evals * eval_iters * global_batch_size, 0


def build_datasets(cfg: DataConfig, *, seed: int, vocab_size: int, num_samples: tuple[int, int | None, int]):
    """(train, valid, test); valid/test may be None (a warning says so when evaluation was asked).
    --sft: --split cuts the conversations (data/sft_dataset.py `split_sft_datasets`);
    --train/valid/test-data-path: one blend per split (data/per_split.py), valid a list of one
    dataset per prefix with --multiple-validation-sets. A valid size of None reads the split
    whole (--full-validation)."""
    if cfg.mock_data:
        return tuple(MockGPTDataset(max(n or 0, 1), cfg.seq_length, vocab_size, seed + i)
                     for i, n in enumerate(num_samples))
    if cfg.dpo:
        train, valid, test = split_preference_datasets(cfg.data_path[0], cfg.split, cfg.seq_length,
                                                       seed, pad_id=cfg.pad_token)
        if train is None:
            raise IndexedDatasetError(f"--split {cfg.split} leaves no pair of --data-path "
                                      f"{cfg.data_path[0]} to train on; give the training split a share")
        what = "pairs"
    elif cfg.sft:
        train, valid, test = split_sft_datasets(cfg.data_path[0], cfg.split, cfg.seq_length, seed,
                                                pad_id=cfg.pad_token,
                                                mode="packed" if cfg.sft_packing else "padded")
        if train is None:
            raise IndexedDatasetError(f"--split {cfg.split} leaves no conversation of --data-path "
                                      f"{cfg.data_path[0]} to train on; give the training split a share")
        what = "conversations"
    elif cfg.per_split is not None:
        train, valid, test = build_per_split_datasets(cfg.per_split, cfg.seq_length, seed, num_samples,
                                                      cfg.data_cache_path, vocab_size=vocab_size,
                                                      multiple_validation_sets=cfg.multiple_validation_sets)
        if valid is None and num_samples[1] != 0 and _first_rank():
            if cfg.per_split[1]:
                logger.warning("--valid-data-path %s holds no validation sample (no document, or "
                               "none longer than --seq-length): evaluation is skipped; give a "
                               "larger validation corpus, or pass --eval-iters 0",
                               " ".join(map(str, cfg.per_split[1])))
            else:
                logger.warning("no --valid-data-path: evaluation is skipped (as Megatron-LM skips "
                               "it); give --valid-data-path PREFIX, or pass --eval-iters 0")
        return train, valid, test
    else:
        train, valid, test = build_train_valid_test_datasets(
            cfg.data_path, cfg.split, cfg.seq_length, seed, num_samples, cfg.data_cache_path,
            vocab_size=vocab_size)
        what = "documents"
    if valid is None and num_samples[1] != 0 and _first_rank():
        logger.warning("--split %s leaves the validation split of --data-path %s with no %s: "
                       "evaluation is skipped; give it a larger share (e.g. --split 969,30,1) or more "
                       "%s, or pass --eval-iters 0", cfg.split, " ".join(map(str, cfg.data_path)), what,
                       what)
    return train, valid, test


def _first_rank() -> bool:
    return C.group_rank(C.world()) == 0


def microbatches(dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp: int,
                 device: torch.device, num_workers: int = 0,
                 eod_mask_token: int | None = None, cp: int = 1, cp_rank: int = 0,
                 documents: DocumentFlags | None = None, pad_mask_token: int | None = None) -> Iterator[dict]:
    """Endless stream of {"tokens": [b, s/cp], "labels": [b, s/cp]} for this DP rank (this context
    rank's chunks of the sequence), from `consumed`.

    With `num_workers` threads, the next 2 x num_workers microbatches are read ahead (same order);
    with `eod_mask_token`, "loss_mask" [b, s] is 0 where the input token is that id (--eod-mask-loss);
    samples with an "assistant_mask" (--sft) give "loss_mask" = that mask on the labels. With
    `documents` (or samples with "document_ids": packed SFT), "document_ids" [b, s] (the whole
    sequence on every context rank: attention needs the keys' documents too) and "position_ids"
    [b, s/cp] (this rank's tokens' positions in their documents, or in the sample). With
    `pad_mask_token` (the tokenizer's own pad id), pretraining samples get "loss_mask" 0 where the
    label is that id, and the id becomes 0 in tokens and labels (after the documents are found), as
    megatron-core's GPTDataset does.
    """
    def indices():
        consumed, total = consumed_samples, len(dataset)
        while True:
            yield from PretrainingSampler(total, consumed % total, micro_batch_size, dp_rank, dp)
            consumed = 0  # wrapped around the dataset: start another pass

    def read(idx) -> dict[str, np.ndarray]:
        samples = [dataset[i] for i in idx]
        return {k: np.stack([np.asarray(s[k]) for s in samples]) for k in samples[0]}

    def to_batch(sample: dict[str, np.ndarray]) -> dict:
        t = torch.from_numpy(sample["tokens"].astype(np.int64, copy=False))
        mb = {"tokens": t[:, :-1], "labels": t[:, 1:]}
        if "assistant_mask" in sample:  # label i is token i + 1: its mask is the token's
            mb["loss_mask"] = torch.from_numpy(sample["assistant_mask"][:, 1:].astype(np.float32))
        elif eod_mask_token is not None:
            mb["loss_mask"] = (mb["tokens"] != eod_mask_token).float()
        docs = None
        if "document_ids" in sample:
            docs = torch.from_numpy(sample["document_ids"][:, :-1].astype(np.int64))
        elif documents is not None:
            docs = documents_after_eod(mb["tokens"], documents.eod)
        if pad_mask_token is not None and "assistant_mask" not in sample:
            padded = mb["labels"] == pad_mask_token
            mb["loss_mask"] = mb.get("loss_mask", torch.ones(padded.shape)).masked_fill(padded, 0.0)
            mb["tokens"] = mb["tokens"].masked_fill(mb["tokens"] == pad_mask_token, 0)
            mb["labels"] = mb["labels"].masked_fill(padded, 0)
        if "counted" in sample:  # WholePass: a filler sample counts no token
            counted = torch.from_numpy(sample["counted"].astype(np.float32))[:, None]
            mb["loss_mask"] = mb.get("loss_mask", torch.ones(mb["labels"].shape)) * counted
        out = {k: split_sequence(x, 1, cp, cp_rank).contiguous().to(device) for k, x in mb.items()}
        if docs is not None:
            reset_positions = documents is None or documents.reset_position_ids
            positions = positions_in_documents(docs) if reset_positions else \
                torch.arange(docs.shape[1]).expand_as(docs)
            out["position_ids"] = split_sequence(positions, 1, cp, cp_rank).contiguous().to(device)
            if documents is None or documents.reset_attention_mask:
                out["document_ids"] = docs.contiguous().to(device)
        return out

    if num_workers == 0:
        for idx in indices():
            yield to_batch(read(idx))
        return
    with ThreadPoolExecutor(num_workers, thread_name_prefix="megazoo-data") as pool:
        ahead: deque = deque()
        for idx in indices():
            ahead.append(pool.submit(read, idx))
            if len(ahead) > 2 * num_workers:
                yield to_batch(ahead.popleft().result())


class WholePass:
    """A pretraining dataset's samples once, then fillers up to `length` (a whole number of global
    batches): --full-validation reads each sample once. Every item carries "counted" (1, or 0
    for a filler: a copy of sample 0 whose tokens count in no loss, `microbatches`)."""

    def __init__(self, dataset, length: int):
        self.dataset, self.length = dataset, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict:
        real = idx < len(self.dataset)
        return {**self.dataset[idx if real else 0], "counted": np.int64(real)}


@dataclass(frozen=True)
class DocumentFlags:
    """--reset-position-ids / --reset-attention-mask over end-of-document ids `eod`."""
    eod: int
    reset_position_ids: bool
    reset_attention_mask: bool


def document_flags(cfg: DataConfig) -> DocumentFlags | None:
    """The packed-document handling the data configuration asks for (None: none)."""
    if not (cfg.reset_position_ids or cfg.reset_attention_mask):
        return None
    return DocumentFlags(cfg.eod_token, cfg.reset_position_ids, cfg.reset_attention_mask)


class TrainData:
    """The training stream: a dataset view without skipped samples, read from a consumed count."""

    def __init__(self, dataset, skip, *, micro_batch_size: int, dp_rank: int, dp: int, device,
                 num_workers: int = 0, eod_mask_token: int | None = None, cp: int = 1, cp_rank: int = 0,
                 documents: DocumentFlags | None = None, pad_mask_token: int | None = None):
        self.base, self.mbs, self.dp_rank, self.dp, self.device = dataset, micro_batch_size, dp_rank, dp, device
        self.reading = dict(num_workers=num_workers, eod_mask_token=eod_mask_token, cp=cp,
                            cp_rank=cp_rank, documents=documents, pad_mask_token=pad_mask_token)
        self.view = SkippingDataset(dataset, list(skip))
        self._it = None

    def restart(self, consumed_samples: int) -> None:
        self.close()
        self._it = microbatches(self.view, consumed_samples=consumed_samples, micro_batch_size=self.mbs,
                                dp_rank=self.dp_rank, dp=self.dp, device=self.device, **self.reading)

    def close(self) -> None:
        if self._it is not None:
            self._it.close()  # stops its read-ahead threads

    def next_global_batch(self, batch: int) -> list[dict]:
        return [next(self._it) for _ in range(batch // (self.mbs * self.dp))]

    def physical_ranges(self, consumed_samples: int, batch: int) -> list[tuple[int, int]]:
        """Dataset sample ranges behind the global batch that starts at `consumed_samples`."""
        n = len(self.view)
        return merge_ranges([(p, p + 1) for p in (self.view.physical((consumed_samples + i) % n)
                                                   for i in range(batch))])

    def skip(self, ranges: list[tuple[int, int]]) -> None:
        self.view = SkippingDataset(self.base, self.view.skip + list(ranges))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint [start, end) ranges covering the same indices."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class SkippingDataset:
    """A dataset view without the samples in `skip` (sorted, disjoint [start, end) ranges).

    Training counts logical samples (consumed_samples); logical index i maps to the i-th physical
    sample not skipped, so a run that skipped a batch and a run that never had it agree.
    """

    def __init__(self, dataset, skip: list[tuple[int, int]]):
        self.dataset, self.skip = dataset, merge_ranges(skip)
        self.skipped = sum(e - s for s, e in self.skip)

    def __len__(self) -> int:
        return len(self.dataset) - self.skipped

    def physical(self, i: int) -> int:
        for s, e in self.skip:
            if i >= s:
                i += e - s
            else:
                break
        return i

    def __getitem__(self, i: int):
        return self.dataset[self.physical(i)]
