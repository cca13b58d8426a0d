"""Megatron-LM's validation flags: ``--full-validation``, ``--multiple-validation-sets`` and
``--validation-set-names``, and the combinations refused before any work (each in one line, listed
with the command line's other refusals).

- ``--full-validation``: every evaluation reads the whole validation set once, as Megatron-LM's
  (the set is built for one epoch, not sized from ``--eval-iters``: training/run/batches.py), and
  ``--eval-iters`` is not used.
- ``--multiple-validation-sets``: each prefix of ``--valid-data-path`` is its own validation set,
  evaluated and logged apart (``valid-0``, ``valid-1``, ... or ``valid-NAME`` with
  ``--validation-set-names``; Megatron-LM's ``validation-0`` ...); no combined loss (Megatron-LM
  reports none).

Refused as Megatron-LM refuses them: ``--multiple-validation-sets`` without ``--full-validation``
(its NotImplementedError), weights in a validation blend read whole (megatron-core's assertion
"size_is_none => weights_are_none"), ``--validation-set-names`` without
``--multiple-validation-sets`` or of another count than the sets. Refused where Megatron-LM would
ignore the flag or fail later: ``--multiple-validation-sets`` without ``--valid-data-path`` (with
``--data-path`` and ``--split`` the validation split is one blend; ``--sft`` and ``--dpo`` cut one
set), ``--full-validation`` with ``--mock-data`` (no finite set), with ``--dpo`` (a padded last
batch of pairs would count in the preference loss) and with ``--grpo-prompts`` (no validation set).
"""
from __future__ import annotations

from megazoo.data.blended import check_blend


def add_validation_flags(group) -> None:
    group.add_argument("--full-validation", action="store_true", help=(
        "each evaluation covers the whole validation set once (built for one epoch), not "
        "--eval-iters global batches"))
    group.add_argument("--multiple-validation-sets", action="store_true", help=(
        "with --full-validation: each prefix of --valid-data-path is a validation set of its own, "
        "its loss logged as valid-0, valid-1, ..."))
    group.add_argument("--validation-set-names", nargs="+", help=(
        "with --multiple-validation-sets: one name per set, logged as valid-NAME"))


def _valid_blend(args) -> tuple[str, list] | None:
    """(flag, tokens) of the validation data: --valid-data-path, else --data-path."""
    if getattr(args, "valid_data_path", None):
        return "--valid-data-path", args.valid_data_path
    if args.data_path:
        return "--data-path", args.data_path
    return None


def _weighted(tokens, flag: str) -> bool:
    try:
        return check_blend(tokens, flag) is not None
    except ValueError:  # a malformed blend is refused with the data flags
        return False


def validation_refusals(args, given: set[str]) -> list[str]:
    """The refusals of the validation flags (one line each); call after the data flags resolved
    (the per-split JSON file read into --train/valid/test-data-path)."""
    full, multiple, names = args.full_validation, args.multiple_validation_sets, args.validation_set_names
    refused: list[str] = []
    if names and not multiple:
        refused.append("--validation-set-names names the sets of --multiple-validation-sets (Megatron-LM "
                       "asserts so too); add --multiple-validation-sets or drop the names")
    if multiple and not full:
        refused.append("--multiple-validation-sets evaluates each set whole: add --full-validation "
                       "(Megatron-LM: '--multiple-validation-sets currently requires --full-validation')")
    blend = _valid_blend(args)
    if multiple:
        if getattr(args, "valid_data_path", None) is None:
            refused.append("--multiple-validation-sets: give the sets as --valid-data-path PREFIX1 PREFIX2 "
                           "(or \"valid\" of --per-split-data-args-path); --data-path with --split, "
                           "--sft and --dpo cut one validation set")
        elif names and len(names) != len(_prefixes(args.valid_data_path)):
            refused.append(f"--validation-set-names gives {len(names)} names for "
                           f"{len(_prefixes(args.valid_data_path))} validation sets (--valid-data-path "
                           f"{' '.join(args.valid_data_path)}); give one name per prefix")
    if full:
        if args.mock_data:
            refused.append("--full-validation reads the validation set whole; --mock-data has no finite "
                           "set: give --data-path or --valid-data-path")
        if getattr(args, "dpo", False):
            refused.append("--full-validation with --dpo: the last batch of held-out pairs would be "
                           "padded with pairs the preference loss counts; evaluate --eval-iters "
                           "batches instead (drop --full-validation)")
        if getattr(args, "grpo_prompts", None):
            refused.append("--full-validation/--multiple-validation-sets: --grpo-prompts has no "
                           "validation set; drop them")
        if blend is not None and not args.sft and _weighted(*reversed(blend)):
            refused.append(f"{blend[0]} {' '.join(map(str, blend[1]))}: --full-validation reads each "
                           f"validation prefix whole, which takes no weights (megatron-core: "
                           f"size_is_none => weights_are_none); give the prefixes without weights")
    return refused


def _prefixes(tokens) -> list[str]:
    try:
        blend = check_blend(tokens, "--valid-data-path")
    except ValueError:  # refused with the data flags
        blend = None
    return blend[1] if blend else [t for item in tokens for t in str(item).split()]
