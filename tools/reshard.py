"""Rewrite a checkpoint for another (tp, pp, vpp, dp, ZeRO stage) layout, optimizer state included.

    python tools/reshard.py --load ckpt/run1 --save ckpt/run1_tp4 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 \
        --data-parallel-size 2 --zero-stage 1

Training can also load another layout directly (`--load` reshards in memory); this tool does it
once, offline, so that every later load reads only its own rank's files.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazoo.models.config import TransformerConfig  # noqa: E402
from megazoo.parallel.zero.config import OptimizerConfig  # noqa: E402
from megazoo.training.checkpoint import format as ckpt  # noqa: E402
from megazoo.parallel.layout import virtual_stages  # noqa: E402
from megazoo.training.checkpoint.layout_writer import write_layout  # noqa: E402
from megazoo.training.checkpoint.reshard import read_full_state  # noqa: E402


def reshard(load: str, save: str, *, tp: int, pp: int, vpp: int = 1, dp: int = 1,
            zero_stage: int = 0, layers_per_virtual_stage: int | None = None, ep: int = 1) -> str:
    folder = ckpt.resolve(load)
    meta = ckpt.read_meta(folder)
    config = TransformerConfig.from_saved(meta["model"])
    vpp = virtual_stages(config.num_layers, pp, layers_per_virtual_stage) \
        if layers_per_virtual_stage else vpp
    OptimizerConfig(zero_stage=zero_stage).validate(pp)  # e.g. ZeRO-3 does not compose with pp > 1
    full = read_full_state(folder)
    return write_layout(full, save, config=config, tp=tp, pp=pp, vpp=vpp, dp=dp,
                        zero_stage=zero_stage, iteration=meta["iteration"], meta=meta,
                        weights_only=bool(meta.get("weights_only")), ep=ep)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1,
                   help="model chunks per pipeline rank")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="Megatron's form of the same (overrides the above)")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks (out of the data-parallel ones) splitting each MoE layer's experts")
    args = p.parse_args(argv)
    try:
        out = reshard(args.load, args.save, tp=args.tensor_model_parallel_size,
                      pp=args.pipeline_model_parallel_size,
                      vpp=args.virtual_pipeline_model_parallel_size, dp=args.data_parallel_size,
                      zero_stage=args.zero_stage,
                      layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                      ep=args.expert_model_parallel_size)
    except (ckpt.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
