"""Megatron-LM flags beyond the core set, so a Megatron launch script runs unchanged.

Implemented here or where the config they set is read: --exit-interval, --exit-duration-in-mins
(training/run/stop.py), --no-load-optim, --no-load-rng (training/checkpoint/resume.py), --eod-mask-loss
(training/run/batches.py, training/run/step.py), --lr-warmup-fraction (training/config/flags.py), --num-workers
(training/run/batches.py), --log-throughput (training/monitor/console.py), --tokenizer-type NullTokenizer
(data/tokenizers.py). Accepted as names for what megazoo always does, with one log line each:
--use-distributed-optimizer (ZeRO-1 unless --zero-stage is given), --overlap-grad-reduce,
--overlap-param-gather, --use-flash-attn, --distributed-backend. docs/megatron.md has the table.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from training.config.errors import ArgumentError

logger = logging.getLogger("megazoo.train")

# What megazoo does in place of each accepted alias (the log line a user sees).
ALIASES = {
    "overlap_grad_reduce": "--overlap-grad-reduce: megazoo always overlaps the data-parallel gradient "
                           "reduction with backward (bucketed, parallel/zero/grad_sync.py)",
    "overlap_param_gather": "--overlap-param-gather: megazoo all-gathers ZeRO-1/2 parameters after the "
                            "step and prefetches the next layer under ZeRO-3; no other overlap",
    "use_flash_attn": "--use-flash-attn: megazoo's attention is torch's scaled_dot_product_attention, "
                      "which picks the flash kernel where the device and dtype allow",
}


@dataclass(frozen=True)
class Compat:
    zero_stage: int
    eod_mask_token: int | None


def add_megatron_compat_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM compatibility (docs/megatron.md)")
    g.add_argument("--exit-interval", type=int,
                   help="stop with a checkpoint (when --save is set) and exit 0 when the iteration is a "
                        "multiple of N")
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="stop with a checkpoint (when --save is set) and exit 0 after this many minutes")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --load: weights and progress only; fresh optimizer state and loss scale")
    g.add_argument("--no-load-rng", action="store_true",
                   help="with --load: seed the RNG streams from --seed instead of restoring them")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss at positions whose input token is the tokenizer's end-of-document")
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="warmup iterations as a fraction of --lr-decay-iters (or of the training "
                        "iterations); instead of --lr-warmup-iters")
    g.add_argument("--num-workers", type=int, default=0,
                   help="threads that read the next microbatches while the step runs (0: read in the "
                        "training thread; Megatron's default is 2 DataLoader processes)")
    g.add_argument("--log-throughput", action="store_true",
                   help="add tokens/s, TFLOP/s per rank and MFU to the console line (always in "
                        "metrics.jsonl, TensorBoard and wandb)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's sharded optimizer: ZeRO-1 here, unless --zero-stage is given")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="accepted; always on in megazoo")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="accepted; megazoo's parameter all-gather is fixed (see docs/megatron.md)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="accepted; attention runs through torch SDPA, which chooses flash kernels")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"],
                   help="accepted; the backend follows the device: nccl with CUDA, gloo on CPU")


def _fail(msg: str):
    raise ArgumentError(msg)


def resolve_megatron_compat(args: argparse.Namespace, eod_token: int | None) -> Compat:
    """Check the compatibility flags, log one line per accepted alias, and return what they set."""
    for name in ("exit_interval", "num_workers"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "exit_interval" else 0):
            _fail(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'exit_interval' else '>= 0'}, "
                  f"got {value}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        _fail(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction <= 1:
            _fail(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        if args.lr_warmup_iters or args.lr_warmup_samples:
            _fail("give one of --lr-warmup-fraction, --lr-warmup-iters and --lr-warmup-samples")
    if args.eod_mask_loss and (args.context_parallel_size or 1) > 1 and not args.calculate_per_token_loss:
        # each context rank averages over its own unmasked tokens: the mean of those means is
        # not the sequence's mean once masks differ per rank (the per-token loss counts globally)
        _fail("--eod-mask-loss with --context-parallel-size > 1 needs --calculate-per-token-loss")
    if args.eod_mask_loss and getattr(args, "sft", False):
        _fail("--eod-mask-loss does not combine with --sft (the assistant mask decides, end-of-turn "
              "included); drop --eod-mask-loss")
    if args.eod_mask_loss and eod_token is None:
        _fail("--eod-mask-loss needs a tokenizer to name the end-of-document id (--vocab-file/"
              "--merge-file, --tokenizer-model, or --tokenizer-type NullTokenizer --vocab-size N)")
    zero_stage = args.zero_stage
    if args.use_distributed_optimizer:
        if zero_stage is None:
            zero_stage = 1
            logger.info("--use-distributed-optimizer: megazoo's ZeRO-1 (optimizer state and fp32 master "
                        "weights sharded over data parallelism; --zero-stage 2/3 shard more)")
        else:
            logger.info("--use-distributed-optimizer: --zero-stage %d given, which decides", zero_stage)
    for name, line in ALIASES.items():
        if getattr(args, name):
            logger.info(line)
    if args.distributed_backend:
        logger.info("--distributed-backend %s: megazoo uses nccl when CUDA is present and gloo "
                    "otherwise", args.distributed_backend)
    return Compat(zero_stage=zero_stage or 0, eod_mask_token=eod_token if args.eod_mask_loss else None)
