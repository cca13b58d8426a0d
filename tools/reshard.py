"""Rewrite a checkpoint for another layout (tp, pp, vpp, cp, ep, an uneven pipeline split, dp,
ZeRO stage), optimizer state included.

    python tools/reshard.py --load ckpt/run1 --save ckpt/run1_tp4 \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 \\
        --data-parallel-size 2 --zero-stage 1

Training can also load another layout directly (`--load` reshards in memory); this tool does it
once, offline, so that every later load reads only its own rank's files. The layout flags are the
trainer's (training/config/layout_flags.py), `--dp` and the other short forms included.
"""
from __future__ import annotations

import argparse
import logging
import sys

from megazoo.models.config import TransformerConfig
from megazoo.parallel.layout import ParallelConfig
from megazoo.parallel.zero.config import OptimizerConfig
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.layout_writer import write_layout
from megazoo.training.checkpoint.reshard import read_full_state
from megazoo.training.config.layout_flags import add_layout_flags, given, parallel_config_of


def reshard(load: str, save: str, *, parallel: ParallelConfig | None = None, dp: int = 1,
            zero_stage: int = 0, **sizes) -> str:
    """`load` rewritten at the layout `parallel` (or its `sizes`, e.g. tp=2) x `dp`."""
    parallel = ParallelConfig.of(parallel, **sizes)
    folder = ckpt.resolve(load)
    meta = ckpt.read_meta(folder)
    config = TransformerConfig.from_saved(meta["model"])
    OptimizerConfig(zero_stage=zero_stage).validate(parallel.pp)  # e.g. ZeRO-3 with pp > 1
    full = read_full_state(folder)
    return write_layout(full, save, config=config, parallel=parallel, dp=dp,
                        zero_stage=zero_stage, iteration=meta["iteration"], meta=meta,
                        weights_only=bool(meta.get("weights_only")))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True)
    p.add_argument("--save", required=True)
    add_layout_flags(p)
    args = p.parse_args(argv)
    try:
        meta = ckpt.read_meta(ckpt.resolve(args.load))
        parallel = parallel_config_of(args, meta["model"]["num_layers"])
        out = reshard(args.load, args.save, parallel=parallel, dp=given(args, "dp"),
                      zero_stage=given(args, "zero_stage"))
    except (ckpt.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
