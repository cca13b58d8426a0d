"""Weighted blending of several GPT datasets and the train/valid/test entry point.

``--data-path`` in Megatron's form: one prefix, or ``0.3 prefixA 0.7 prefixB`` (weights are
normalised). Each prefix is split with the same split string. As megatron-core's
BlendedMegatronDatasetBuilder: a split asked for ``n`` samples targets ``ceil(n * w)`` samples of
each component and builds ``ceil(ceil(n * w) * 1.005)`` of them (the surplus keeps the greedy blend
from running past a component's end); the blend holds the sum of the targets (a little more than
``n``). Several prefixes without weights: each split of each is built for one epoch and the blend
weighs them by those sample counts, holding ``min(n, their sum)`` samples; a split asked for
``None`` samples (--full-validation) holds every sample of each prefix once, interleaved as
megatron-core's exhaustive blend (weights are refused there, as megatron-core refuses them).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from megazoo.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_split_datasets
from megazoo.data.index_cache import CachedIndices
from megazoo.data.token_stats import check_vocabulary

logger = logging.getLogger(__name__)

BLEND_SURPLUS = 0.005  # megatron-core's default mid_level_dataset_surplus


@dataclass(frozen=True)
class Blend:
    prefixes: list[str]
    weights: list[float] | None  # normalised to sum to 1; None: by the components' sample counts


def normalize(weights) -> list[float]:
    """Weights divided by their sum in float64, as megatron-core does (the same rounding)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def _tokens(data_path: list[str] | str) -> list[str]:
    return data_path.split() if isinstance(data_path, str) else [t for item in data_path for t in str(item).split()]


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def check_blend(data_path: list[str] | str, flag: str = "--data-path") -> tuple[list[float], list[str]] | None:
    """(weights, prefixes) of a weighted ``--data-path`` (or the per-split `flag`), None for plain
    prefixes; a malformed blend (odd length, a weight that is nan, inf or negative, all zero) is a
    ValueError."""
    tokens = _tokens(data_path)
    if len(tokens) < 2 or _number(tokens[0]) is None:
        return None
    if len(tokens) % 2:
        raise ValueError(f"{flag} has {len(tokens)} items; a blend alternates weights and prefixes "
                         f"(W1 PREFIX1 W2 PREFIX2 ...)")
    weights, prefixes = [_number(w) for w in tokens[0::2]], tokens[1::2]
    for w, raw, prefix in zip(weights, tokens[0::2], prefixes):
        if w is None or not math.isfinite(w) or w < 0:
            raise ValueError(f"{flag} weight {raw!r} of {prefix} must be a finite number >= 0")
    if sum(weights) <= 0:
        raise ValueError(f"{flag} weights {weights} are all zero")
    return weights, prefixes


def blend_prefixes(data_path: list[str] | str) -> list[str]:
    """The dataset prefixes of a --data-path (weighted or not)."""
    blend = check_blend(data_path)
    return blend[1] if blend else _tokens(data_path)


def parse_data_path(data_path: list[str] | str, flag: str = "--data-path") -> Blend:
    """Megatron ``--data-path`` tokens -> prefixes and normalised weights (None without weights:
    several prefixes are then blended by their sample counts)."""
    tokens = _tokens(data_path)
    if not tokens:
        raise ValueError(f"{flag} is empty; pass a prefix such as my-corpus_text_document")
    if len(tokens) == 1:
        return Blend([tokens[0]], None)
    blend = check_blend(tokens, flag)
    if blend is None:
        return Blend(tokens, None)
    weights, prefixes = blend
    return Blend(prefixes, normalize(weights))


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of each dataset once (`sizes[d]` of dataset d), interleaved by the same
    greedy rule with weights sizes / sum(sizes), a dataset dropping out once spent: megatron-core's
    `build_exhaustive_blending_indices` (a blend with no size: --full-validation)."""
    total = int(sum(sizes))
    if total == 0:  # nothing to read (an empty split: the callers build no dataset of it)
        return np.empty(0, dtype=np.int16), np.empty(0, dtype=np.int64)
    weights = [s / total for s in sizes]
    dataset_index = np.empty(total, dtype=np.int16)
    sample_index = np.empty(total, dtype=np.int64)
    counts, unspent = [0] * len(sizes), [d for d, s in enumerate(sizes) if s > 0]
    for i in range(total):
        x = float(max(i, 1))
        best = max(unspent, key=lambda d: (weights[d] * x - counts[d], -d))
        dataset_index[i], sample_index[i] = best, counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: each sample goes to the dataset furthest behind its target share.

    Returns (dataset index int16, sample index within that dataset int64). A plain loop over the
    samples; it runs once per configuration and is cached (about 1 s per million samples).
    """
    n = len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * n
    rng = range(1, n)
    for i in range(size):
        x = float(max(i, 1))
        best, best_err = 0, weights[0] * x - counts[0]
        for d in rng:
            err = weights[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Interleaves component datasets by weight; item ``i`` is an item of one component."""

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int | None, cache_dir: str,
                 name: str) -> None:
        """`size` None: every sample of each dataset once, `weights` being their sizes."""
        self.datasets, self.weights = datasets, weights
        self.size = int(sum(weights)) if size is None else size
        description = {
            "class": "BlendedDataset",
            "components": [d.cache.description_path for d in datasets],
            "weights": weights,
            "size": size,
        }
        self.cache = CachedIndices(cache_dir, f"BlendedDataset-{name}", description, ("dataset_index", "dataset_sample_index"))

        def build() -> dict[str, np.ndarray]:
            di, si = build_exhaustive_blending_indices([int(w) for w in weights]) if size is None \
                else build_blending_indices(weights, size)
            for d, ds in enumerate(datasets):  # the margin should make this impossible; check anyway
                used = si[di == d]
                if used.size and int(used.max()) >= len(ds):
                    raise ValueError(f"blend needs {int(used.max()) + 1} samples of component {d}, it has {len(ds)}")
            return {"dataset_index": di, "dataset_sample_index": si}

        arrays = self.cache.build_or_load(build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        d = int(self.dataset_index[idx])
        item = self.datasets[d][int(self.dataset_sample_index[idx])]
        item["dataset_id"] = d
        return item


def build_train_valid_test_datasets(
    data_path: list[str] | str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    vocab_size: int | None = None,
):
    """(train, valid, test) datasets for Megatron-style arguments; None for a split with no share
    or no samples asked for.

    With `vocab_size`, every prefix is first checked against the model's vocabulary (token ids
    and .idx dtype, `data/token_stats.py`)."""
    blend = parse_data_path(data_path)
    if vocab_size is not None:
        check_vocabulary(blend.prefixes, vocab_size)
    config = GPTDatasetConfig(seq_length=seq_length, seed=seed, cache_dir=cache_dir)
    if len(blend.prefixes) == 1 and blend.weights is None:  # "--data-path 1 a" is a blend of one
        return tuple(build_split_datasets(blend.prefixes[0], split, tuple(num_samples), config))
    return build_blend_splits(blend, split, tuple(num_samples), config)


def build_blend_splits(blend: Blend, split: str, num_samples: tuple[int, int, int], config: GPTDatasetConfig):
    """(train, valid, test) BlendedDatasets of several prefixes (or a weighted one), each prefix cut
    by `split`, as megatron-core's BlendedMegatronDatasetBuilder blends them."""
    if blend.weights is None:  # one epoch of each, blended by their sample counts
        targets = None
        wanted = [tuple(0 if n == 0 else None for n in num_samples)] * len(blend.prefixes)
    elif None in num_samples:
        raise ValueError(f"a split read whole (--full-validation) takes no weights (megatron-core: "
                         f"size_is_none => weights_are_none); give the prefixes {' '.join(blend.prefixes)} "
                         f"without weights")
    else:  # each split's target share, built with the surplus
        targets = [[math.ceil(n * w) for n in num_samples] for w in blend.weights]
        wanted = [tuple(math.ceil(t * (1 + BLEND_SURPLUS)) for t in ts) for ts in targets]
    per_prefix = [build_split_datasets(p, split, n, config) for p, n in zip(blend.prefixes, wanted)]
    blend_cache = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(blend.prefixes[0])), "cache",
                                                   "BlendedDataset_indices")
    out = []
    for i, name in enumerate(("train", "valid", "test")):
        parts = [(ds[i], k) for k, ds in enumerate(per_prefix) if ds[i] is not None]
        exhaustive = targets is None and num_samples[i] is None
        if not parts or num_samples[i] == 0 or exhaustive and not any(len(d) for d, _ in parts):
            # (read whole, parts of 0 samples, their documents shorter than --seq-length + 1: empty)
            out.append(None)
            continue
        empty = [blend.prefixes[k] for k, ds in enumerate(per_prefix) if ds[i] is None]
        if empty:  # megatron-core never returns here; megazoo blends the others, and says so
            logger.warning("--data-path: the %s split of --split %s holds no document of %s; "
                           "blending the other prefixes alone (give it a larger share or drop "
                           "it)", name, split, ", ".join(empty))
        if exhaustive:  # read whole (--full-validation)
            out.append(BlendedDataset([d for d, _ in parts], [len(d) for d, _ in parts], None,
                                      blend_cache, name))
            continue
        if targets is None:
            weights = [len(d) for d, _ in parts]
            size = min(num_samples[i], sum(weights))
            if size < num_samples[i]:
                logger.warning("--data-path without weights blends one epoch of each prefix: the "
                               "%s split holds %d of the %d samples asked, and is read again in "
                               "the same order; give weights for more epochs", name, size,
                               num_samples[i])
        else:
            weights = [blend.weights[k] for _, k in parts]
            size = sum(targets[k][i] for _, k in parts)
        out.append(BlendedDataset([d for d, _ in parts], normalize(weights), size, blend_cache, name))
    return tuple(out)
