"""Per-split blends: Megatron-LM's ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``
(megatron-core's ``blend_per_split``).

Each split names its own prefixes (one, several, or a weighted blend) and takes every document of
them; ``--split`` is not used. As megatron-core's BlendedMegatronDatasetBuilder builds them:

- a split given no path has no dataset;
- a split of one prefix is that prefix's GPTDataset of the split's size, even when a weight is
  written before it (``--train-data-path 1 a``; with ``--data-path`` that is a blend of one);
- several prefixes are blended as ``--data-path`` blends them (data/blended.py), each prefix cut
  whole into this split.

The samples and their order are megatron-core's for the same split; the split's name is part of
each cache key, so a prefix's ``valid`` and ``train`` datasets are cached apart.
"""
from __future__ import annotations

import logging

from megazoo.data.blended import build_blend_splits, parse_data_path
from megazoo.data.gpt_dataset import SPLIT_NAMES, GPTDatasetConfig, build_split_datasets
from megazoo.data.indexed import IndexedDatasetError
from megazoo.data.token_stats import check_vocabulary

logger = logging.getLogger(__name__)

FLAGS = tuple(f"--{name}-data-path" for name in SPLIT_NAMES)
# the whole of a prefix in split i: megatron-core's split matrix entry (0.0, 1.0) for that split
WHOLE_SPLIT = ("1,0,0", "0,1,0", "0,0,1")


def per_split_prefixes(blends) -> list[str]:
    """Every prefix the three per-split blends name (None: a split without a path), in order."""
    return [p for flag, b in zip(FLAGS, blends) if b for p in parse_data_path(b, flag).prefixes]


def build_per_split_datasets(
    blends,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    vocab_size: int | None = None,
    multiple_validation_sets: bool = False,
):
    """(train, valid, test) from one blend per split (each a --data-path-style list, or None for
    no dataset); None also where a split is asked for no samples. A split asked for None samples
    is read whole: one epoch of each prefix (several unweighted prefixes blended exhaustively), as
    megatron-core builds it for --full-validation. With `multiple_validation_sets`, valid is a
    list: one dataset per prefix of its blend (--multiple-validation-sets).

    With `vocab_size`, every prefix of every split (the test split's too) is first checked against
    the model's vocabulary (data/token_stats.py)."""
    if len(blends) != 3:
        raise ValueError(f"per-split blends: give 3 (train, valid, test), got {len(blends)}")
    parsed = [parse_data_path(b, flag) if b else None for flag, b in zip(FLAGS, blends)]
    if vocab_size is not None:
        check_vocabulary([p for b in parsed if b for p in b.prefixes], vocab_size)
    config = GPTDatasetConfig(seq_length=seq_length, seed=seed, cache_dir=cache_dir)
    out = []
    for i, blend in enumerate(parsed):
        sizes = tuple(num_samples[i] if j == i else 0 for j in range(3))
        if blend is None or num_samples[i] == 0:
            out.append(None)
        elif i == 1 and multiple_validation_sets:  # each prefix its own set, as megatron-core
            sets = [build_split_datasets(p, WHOLE_SPLIT[i], sizes, config)[i] for p in blend.prefixes]
            empty = [p for p, d in zip(blend.prefixes, sets) if d is None]
            if empty:
                raise IndexedDatasetError(
                    f"{FLAGS[i]} with --multiple-validation-sets: {', '.join(empty)} holds no "
                    f"document, so its validation set would be empty; drop it from {FLAGS[i]}")
            out.append(sets)
        elif len(blend.prefixes) == 1:  # weighted or not: the plain dataset
            out.append(build_split_datasets(blend.prefixes[0], WHOLE_SPLIT[i], sizes, config)[i])
        else:
            out.append(build_blend_splits(blend, WHOLE_SPLIT[i], sizes, config)[i])
    logger.info("per-split blends: %s", ", ".join(
        f"{name} {'none' if d is None else '+'.join(str(len(x)) for x in d) if isinstance(d, list) else len(d)}"
        for name, d in zip(SPLIT_NAMES, out)))
    return tuple(out)
