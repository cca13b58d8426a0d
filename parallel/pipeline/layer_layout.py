"""Megatron-core's `--pipeline-model-parallel-layout` string: which layers each pipeline block holds.

The string lists the pp x vpp blocks in model order, separated by '|'; in each block 'E' is the
embedding, 't' one decoder layer and 'L' the final norm, head and loss. 'x*n' repeats one
character and '(...)*n' a group (which may span '|'); commas are cosmetic. Examples:

    "Et*3|t*5L"          pp 2: three layers on the first stage, five on the last
    "Ett|(tt|)*2tL"      pp 4 (or pp 2 x vpp 2): 2, 2, 2, 1 layers

megazoo runs the subset where the embedding opens the first block and the loss closes the last
(so every block holds only decoder layers otherwise); 'm' (multi-token prediction) and encoder
layers are refused. The parsed form is the tuple of decoder layers per block, which is what the
partition (partition.py), the checkpoint's layout record and the resharder carry.
"""
from __future__ import annotations

import re

from megazoo.parallel.errors import LayoutError

FLAG = "--pipeline-model-parallel-layout"


def _unroll(text: str) -> str:
    text = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):
        previous = None
        while previous != text:
            previous = text
            text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def parse_layout(text: str) -> tuple[int, ...]:
    """Decoder layers per block, in model order, of a layout string; one-line refusals."""
    if not isinstance(text, str) or not text.strip():
        raise LayoutError(f"{FLAG}: give a string such as 'Et*3|t*5L'")
    blocks = _unroll(text).split("|")
    bad = sorted({c for b in blocks for c in b} - set("EtL"))
    if bad:
        raise LayoutError(f"{FLAG} {text!r}: megazoo runs 'E' (embedding), 't' (decoder layer) and "
                          f"'L' (loss) only, not {''.join(bad)!r}; drop multi-token prediction "
                          f"('m') and unbalanced parentheses")
    flat = "".join(blocks)
    if flat.count("E") != 1 or flat.count("L") != 1 or not blocks[0].startswith("E") \
            or not blocks[-1].endswith("L"):
        raise LayoutError(f"{FLAG} {text!r}: the embedding 'E' must open the first stage and the "
                          f"loss 'L' close the last, once each (e.g. 'Et*3|t*5L')")
    return tuple(b.count("t") for b in blocks)


def format_layout(counts) -> str:
    """The layout string of decoder layers per block (the inverse of `parse_layout`)."""
    parts = [("t*%d" % n if n > 1 else "t" * n) for n in counts]
    return "|".join(("E" if i == 0 else "") + p + ("L" if i == len(parts) - 1 else "")
                    for i, p in enumerate(parts))


def check_layout(counts, num_layers: int, pp: int, vpp: int) -> list[int]:
    """`counts` against the model and the pipeline sizes; the block sizes."""
    if len(counts) != pp * vpp:
        raise LayoutError(f"{FLAG} {format_layout(counts)!r} lists {len(counts)} stages; "
                          f"--pipeline-model-parallel-size {pp} x virtual {vpp} needs {pp * vpp}")
    if sum(counts) != num_layers:
        raise LayoutError(f"{FLAG} {format_layout(counts)!r} places {sum(counts)} decoder layers; "
                          f"the model has {num_layers} (--num-layers)")
    return list(counts)
