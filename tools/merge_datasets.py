"""Merge several indexed datasets (.bin/.idx pairs with the same dtype) into one, in order.

    python tools/merge_datasets.py --input out/shards --output-prefix out/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab_text_document

--input takes prefixes, or folders whose .idx/.bin pairs are merged in sorted name order.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from megazoo.data.indexed import IndexedDatasetError, merge_datasets  # noqa: E402
from megazoo.data.token_stats import merge_stats  # noqa: E402


def expand(inputs: list[str]) -> list[str]:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            if not found:
                raise IndexedDatasetError(f"{item}: no .idx files in this folder; pass dataset prefixes or a folder of them")
            prefixes.extend(found)
        else:
            prefixes.append(item[:-4] if item.endswith((".idx", ".bin")) else item)
    return prefixes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or folders of them")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes = expand(args.input)
        merged = merge_datasets(prefixes, args.output_prefix, progress=lambda xs: tqdm(xs, desc="merging", unit="dataset"))
        merge_stats(prefixes, args.output_prefix)
    except (IndexedDatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents} documents, "
          f"{int(merged.sequence_lengths.sum())} tokens ({merged.dtype.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
