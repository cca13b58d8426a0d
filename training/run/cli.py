"""Console entry points of the installed package (pyproject's [project.scripts]).

Each `megazoo-train-*` command is the checkout's `train_*.py` script: the same Megatron flags,
the same default family. Run them under torchrun with `--no-python`, or as modules:
`torchrun --nproc_per_node 4 -m megazoo.training.run.cli gpt ...`.
"""
from __future__ import annotations

import sys

from .entry import main

SCRIPTS = {"gpt": "gpt2", "bloom": "bloom", "llama": "llama", "qwen": "qwen3", "moe": "mixtral"}


def _train(family: str) -> None:
    main(default_family=family)  # exits with the run's code; returns when the run finished


def train_gpt() -> None:
    _train(SCRIPTS["gpt"])


def train_bloom() -> None:
    _train(SCRIPTS["bloom"])


def train_llama() -> None:
    _train(SCRIPTS["llama"])


def train_qwen() -> None:
    _train(SCRIPTS["qwen"])


def train_moe() -> None:
    _train(SCRIPTS["moe"])


if __name__ == "__main__":  # python -m megazoo.training.run.cli {gpt,bloom,llama,qwen,moe} FLAGS
    if len(sys.argv) < 2 or sys.argv[1] not in SCRIPTS:
        sys.exit(f"usage: python -m megazoo.training.run.cli {{{','.join(SCRIPTS)}}} [flags]")
    kind = sys.argv.pop(1)
    _train(SCRIPTS[kind])
