"""Foreign checkpoints -> megazoo checkpoints of any layout, and back (one entry per format).

Import reads the foreign files into full tensors (weights, and where present the fp32 masters,
Adam moments and step counts) and writes them with `layout_writer.write_layout` for the target layout;
`--load` then continues the run (iteration, consumed samples and optimizer state carried over)
under any layout. Export reads a megazoo checkpoint of any layout and writes the foreign one.
"""
from __future__ import annotations

import logging

from megazoo.parallel.layout import ParallelConfig

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import (deepspeed, deepspeed_universal, megatron_dist,
                                                 megatron_legacy, torchtitan)
from megazoo.training.checkpoint.hf import checkpoint_config
from megazoo.training.checkpoint.layout_writer import write_layout
from megazoo.training.checkpoint.reshard import read_full_state

logger = logging.getLogger(__name__)

READERS = {"megatron": megatron_legacy.read, "megatron-dist": megatron_dist.read,
           "deepspeed": deepspeed.read, "torchtitan": torchtitan.read}
WRITERS = {"megatron": megatron_legacy.write, "megatron-dist": megatron_dist.write,
           "deepspeed": deepspeed_universal.write, "torchtitan": torchtitan.write}
# formats whose export takes no layout (refused before the checkpoint is read)
LAYOUT_CHECKS = {"torchtitan": torchtitan.check_layout}
# formats whose files record no model configuration: --hf-config gives it
HF_CONFIG = {"deepspeed", "torchtitan"}


def import_checkpoint(fmt: str, load: str, save: str, *, parallel: ParallelConfig | None = None,
                      dp: int | None = None, zero_stage: int = 0, optimizer: bool = True,
                      vocab_size: int | None = None, hf_config: str | None = None,
                      **sizes) -> str:
    """Convert a foreign checkpoint into a megazoo checkpoint for the layout `parallel` (or its
    `sizes`, e.g. tp=2) x `dp`; experts split over data x context parallel ranks, so dp defaults
    to ep / cp (at least 1)."""
    if fmt not in READERS:
        raise ckpt.CheckpointError(f"--format {fmt!r}: import reads {sorted(READERS)}")
    parallel = ParallelConfig.of(parallel, **sizes)
    dp = dp or max(1, parallel.ep // parallel.cp)
    parallel.validate(parallel.tp * parallel.pp * parallel.cp * dp)
    extra = {"hf_config": hf_config} if hf_config else {}  # DeepSpeed ZeRO, torchtitan: shapes
    if extra and fmt not in HF_CONFIG:
        raise ckpt.CheckpointError(f"--hf-config applies to --format "
                                   f"{'/'.join(sorted(HF_CONFIG))} only, not {fmt}")
    name, config, full, iteration = READERS[fmt](load, vocab_size, optimizer=optimizer, **extra)
    out = write_layout(full, save, config=config, parallel=parallel, dp=dp, zero_stage=zero_stage,
                       iteration=iteration, weights_only=not full.optim)
    logger.info("imported %s (%s, %s) into %s at %s dp=%d, iteration %d, %s", load, fmt, name,
                out, parallel, dp, iteration,
                "with optimizer state" if full.optim else "weights only")
    return out


def export_checkpoint(fmt: str, load: str, save: str, *,
                      parallel: ParallelConfig | None = None, universal_names: str | None = None,
                      **sizes) -> str:
    """Write a megazoo checkpoint (any layout) as a foreign checkpoint for the layout `parallel`
    (or its `sizes`; its tp, pp and vpp: what the foreign files are split by)."""
    parallel = ParallelConfig.of(parallel, **sizes)
    if fmt not in WRITERS:
        raise ckpt.CheckpointError(f"--format {fmt!r}: export writes {sorted(WRITERS)}")
    if fmt in LAYOUT_CHECKS:  # before anything is read
        LAYOUT_CHECKS[fmt](parallel.tp, parallel.pp, parallel.vpp)
    folder = ckpt.require_verified(ckpt.resolve(load))
    meta, config = checkpoint_config(folder)
    full = read_full_state(folder)
    extra = {}
    if universal_names is not None:  # DeepSpeed universal: whose parameter names
        if fmt != "deepspeed":
            raise ckpt.CheckpointError(f"--universal-names applies to --format deepspeed only, "
                                       f"not {fmt}")
        extra["names"] = universal_names
    return WRITERS[fmt](full, config, save, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp,
                        iteration=meta["iteration"], **extra)
