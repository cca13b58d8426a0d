"""Megatron-DeepSpeed's `--train/valid/test-weighted-split-paths-path FILE`, as --data-path and --split.

Each file holds one line of double-quoted groups, `"NAME: W1 START:END PREFIX1, W2 START:END PREFIX2"`
(the format BigScience's `load_ratios_meg_ds_format.py` writes): a blend of datasets, each read over
the document range START:END (fractions). megazoo blends with `--data-path W1 PREFIX1 W2 PREFIX2`
and cuts every dataset at the same `--split` fractions, so the files map when the train, valid and
test groups blend the same datasets with the same weights over adjacent ranges that are the same
for every dataset (BLOOM's 0:0.950 train and 0.950:1.0 valid); anything else is refused with why.
"""
from __future__ import annotations

SPLITS = ("train", "valid", "test")


class WeightedSplitError(ValueError):
    """The file cannot be mapped; the message names the flag and the file."""


def read_group_file(flag: str, path: str) -> list[tuple[str, list[tuple[float, float, float, str]]]]:
    """Groups of (weight, start, end, prefix), as Megatron-DeepSpeed parses the file."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise WeightedSplitError(f"{flag} {path}: {e.strerror}") from None
    if len(lines) != 1 or not lines[0].startswith('"') or not lines[0].rstrip("\n").endswith('"'):
        raise WeightedSplitError(f'{flag} {path}: expected one line of "NAME: WEIGHT START:END PREFIX, '
                                 f'..." groups in double quotes')
    groups = []
    for text in lines[0].rstrip("\n")[1:-1].split('" "'):
        name, _, body = text.partition(":")
        entries = []
        for item in body.split(","):
            parts = item.split()
            if len(parts) != 3 or parts[1].count(":") != 1:
                raise WeightedSplitError(f"{flag} {path}: {item.strip()!r} is not WEIGHT START:END PREFIX")
            start, end = (float(x) for x in parts[1].split(":"))
            if not 0 <= start < end <= 1:
                raise WeightedSplitError(f"{flag} {path}: range {parts[1]} must satisfy 0 <= START < END <= 1")
            entries.append((float(parts[0]), start, end, parts[2]))
        groups.append((name.strip(), entries))
    return groups


def to_data_path_and_split(files: dict[str, str]) -> tuple[list[str], str]:
    """`files`: split name -> (flag, path) of the given files. Returns (--data-path, --split)."""
    if "train" not in files:
        raise WeightedSplitError("--valid/--test-weighted-split-paths-path need "
                                 "--train-weighted-split-paths-path")
    ranges, blend = {}, None
    for split in SPLITS:
        if split not in files:
            continue
        flag, path = files[split]
        groups = read_group_file(flag, path)
        if len(groups) != 1:
            raise WeightedSplitError(f"{flag} {path}: {len(groups)} groups; megazoo validates on one "
                                     f"blend (the training blend's held-out split): keep one group")
        entries = groups[0][1]
        this_blend = [(w, prefix) for w, _, _, prefix in entries]
        if blend is None:
            blend = this_blend
        elif this_blend != blend:
            raise WeightedSplitError(f"{flag} {path}: blends other datasets or weights than "
                                     f"--train-weighted-split-paths-path; megazoo cuts {split} from "
                                     f"the training blend: give the same datasets and weights")
        spans = {(start, end) for _, start, end, _ in entries}
        if len(spans) != 1:
            raise WeightedSplitError(f"{flag} {path}: the datasets have different ranges "
                                     f"{sorted(spans)}; megazoo cuts every dataset at the same "
                                     f"--split fractions")
        ranges[split] = spans.pop()
    if "test" not in ranges:  # the unread tail: megazoo's --split fractions are normalised
        tail = max(ranges.get("valid", ranges["train"])[1], ranges["train"][1])
        ranges["test"] = (tail, 1.0)
    elif ranges["test"][1] < 1:
        raise WeightedSplitError(f"the test range ends at {ranges['test'][1]}; megazoo's splits cover "
                                 f"each dataset whole: end it at 1")
    edge, split_text = 0.0, []
    for split in SPLITS:
        start, end = ranges.get(split, (edge, edge))
        if abs(start - edge) > 1e-9:
            raise WeightedSplitError(f"the {split} range starts at {start}, not where the previous "
                                     f"split ends ({edge}); megazoo's splits are adjacent")
        split_text.append(f"{end - start:.6g}")
        edge = end
    data_path = [x for w, prefix in blend for x in (f"{w:g}", prefix)]
    return data_path, ",".join(split_text)
