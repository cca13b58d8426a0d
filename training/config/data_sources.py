"""Megatron-LM's other ways to name the pretraining data: per-split blends and the args-path files.

- ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``: one blend per split
  (megatron-core's ``blend_per_split``, built by data/per_split.py); ``--split`` is not used.
- ``--per-split-data-args-path FILE``: a JSON object with the keys ``train``, ``valid`` and
  ``test``, each a list (``["0.3", "a", "0.7", "b"]``), a string (split at whitespace) or null
  (no dataset), as Megatron-LM's ``get_blend_and_blend_per_split`` reads it.
- ``--data-args-path FILE``: the ``--data-path`` list, whitespace-separated in a text file.

Refused in one line, as Megatron-LM refuses them (asserts): ``--data-path`` with
``--data-args-path``; ``--train/valid/test-data-path`` with ``--per-split-data-args-path``;
per-split blends with ``--split`` (megatron-core: "split and blend_per_split are incompatible");
``--data-args-path`` without ``--split`` (Megatron-LM's default split applies to ``--data-path``
only). Megatron-LM takes ``--data-path`` and silently ignores per-split paths given beside it;
megazoo refuses the pair. Also refused: per-split blends without a training path (nothing to train
on), beside ``--mock-data`` or the Megatron-DeepSpeed split files, and for ``--sft`` / ``--dpo`` /
``--grpo-prompts`` (one --data-path set each).
"""
from __future__ import annotations

import json

from megazoo.data.blended import check_blend

SPLITS = ("train", "valid", "test")
PER_SPLIT_FLAGS = tuple(f"--{s}-data-path" for s in SPLITS)


def add_data_source_flags(group) -> None:
    """The flags, in the parser's data group."""
    for split, flag in zip(SPLITS, PER_SPLIT_FLAGS):
        group.add_argument(flag, nargs="*", default=None, help=(
            f"the {'validation' if split == 'valid' else split} split's own prefixes, optionally "
            f"weighted (W1 PREFIX1 W2 PREFIX2); every document of them; instead of --data-path and "
            f"--split (Megatron-LM's per-split blends)"))
    group.add_argument("--data-args-path", help=(
        "a text file holding the --data-path list (whitespace-separated); give --split too"))
    group.add_argument("--per-split-data-args-path", help=(
        'a JSON file {"train": [...], "valid": [...], "test": [...]} holding the three per-split '
        "blends (a list, a string or null each)"))


def per_split_given(args) -> bool:
    return any(getattr(args, f"{s}_data_path", None) is not None for s in SPLITS)


def resolve_data_sources(args, given: set[str], notes) -> list[str]:
    """Read the args-path files into --data-path / the per-split paths and check the combination;
    returns the refusals (one line each)."""
    refused: list[str] = []
    per_split_flags = per_split_given(args)
    if args.data_args_path is not None:
        if args.data_path:
            return ["--data-path and --data-args-path name the data twice (Megatron-LM refuses both "
                    "together too); give one"]
        if "split" not in given:
            return [f"--data-args-path {args.data_args_path}: give --split too (Megatron-LM applies "
                    f"its default 969,30,1 to --data-path only and stops without a split)"]
        tokens, error = _read_text(args.data_args_path)
        if error:
            return [error]
        args.data_path = tokens
        notes.info("--data-args-path %s: --data-path %s", args.data_args_path, " ".join(tokens))
    if args.per_split_data_args_path is not None:
        if per_split_flags:
            return ["--train/valid/test-data-path and --per-split-data-args-path name the splits twice "
                    "(Megatron-LM refuses both together too); give one"]
        blends, error = _read_per_split(args.per_split_data_args_path)
        if error:
            return [error]
        for split, blend in zip(SPLITS, blends):
            setattr(args, f"{split}_data_path", blend)
        notes.info("--per-split-data-args-path %s: %s", args.per_split_data_args_path, "; ".join(
            f"--{s}-data-path {' '.join(b) if b is not None else '(none)'}" for s, b in zip(SPLITS, blends)))
    if not per_split_given(args):
        return refused
    what = "--per-split-data-args-path" if args.per_split_data_args_path else "--train/valid/test-data-path"
    if args.data_path:
        return [f"--data-path{' (--data-args-path)' if args.data_args_path else ''} and {what} name the "
                f"data twice (Megatron-LM would use --data-path and ignore the per-split paths); give one"]
    if "split" in given:
        refused.append(f"--split {args.split} cuts --data-path; {what} give each split whole "
                       f"(megatron-core refuses split with blend_per_split); drop --split")
    if args.mock_data:
        refused.append(f"--mock-data and {what} are two data sources; give one")
    for name in ("sft", "dpo", "grpo_prompts"):
        if getattr(args, name, None):
            refused.append(f"--{name.replace('_', '-')} reads one --data-path set; {what} are for "
                           f"pretraining data")
    if not args.train_data_path:
        refused.append(f"{what} without a training path: nothing to train on; give --train-data-path")
    for split, flag in zip(SPLITS, PER_SPLIT_FLAGS):
        blend = getattr(args, f"{split}_data_path")
        if blend is None:
            continue
        if not blend:
            refused.append(f"{flag} is empty; give a prefix, or leave the flag out for no {split} data")
            continue
        try:
            check_blend(blend, flag)
        except ValueError as e:
            refused.append(str(e))
        refused += [f"{flag} {p}: give the prefix without the suffix, {flag} {p[:-4]}"
                    for p in blend if str(p).endswith((".bin", ".idx"))]
    return refused


def _read_text(path: str) -> tuple[list[str], str | None]:
    try:
        with open(path, encoding="utf-8") as f:
            tokens = f.read().split()
    except (OSError, UnicodeDecodeError) as e:
        return [], f"--data-args-path {path}: cannot be read ({e}); give a text file of prefixes"
    if not tokens:
        return [], f"--data-args-path {path}: the file is empty; write the --data-path list into it"
    return tokens, None


def _read_per_split(path: str) -> tuple[list, str | None]:
    """The three blends of a --per-split-data-args-path file (None where null), or an error line."""
    flag = f"--per-split-data-args-path {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        return [], f"{flag}: cannot be read ({e}); give a JSON file"
    except json.JSONDecodeError as e:
        return [], f"{flag}: not valid JSON ({e}); write {{\"train\": [...], \"valid\": [...], \"test\": [...]}}"
    if not isinstance(data, dict) or any(s not in data for s in SPLITS):
        missing = [s for s in SPLITS if not isinstance(data, dict) or s not in data]
        return [], (f"{flag}: needs the keys \"train\", \"valid\" and \"test\" (missing {', '.join(missing)}); "
                    f"give null for a split without data")
    blends = []
    for s in SPLITS:
        value = data[s]
        if isinstance(value, str):
            value = value.split()
        elif isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                             for v in value):
            value = [str(v) for v in value]
        elif value is not None:
            return [], (f"{flag}: \"{s}\" must be a list of weights and prefixes, a string or null, "
                        f"not {type(value).__name__}")
        blends.append(value)
    return blends, None
