"""Megatron-LM and Megatron-DeepSpeed compatibility flags checked once the model and the layout
are known (training/config/flags.py calls these after `megatron_compat.translate` has mapped the
command line): their values' ranges, what they set (`Compat`: the ZeRO stage of
--use-distributed-optimizer, the token --eod-mask-loss masks), the vocabulary padding of
--pad-vocab-size-to, the stage sizes of --pp-partition-method, and sample counts as iterations.
Each refusal is one line naming the flag (ArgumentError)."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from megazoo.training.config.errors import ArgumentError

logger = logging.getLogger("megazoo.train")


@dataclass(frozen=True)
class Compat:
    zero_stage: int
    eod_mask_token: int | None


def _fail(msg: str):
    raise ArgumentError(msg)


def resolve_megatron_compat(args: argparse.Namespace, eod_token: int | None) -> Compat:
    """Check the compatibility flags' values and return what they set."""
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
    if args.exit_on_missing_checkpoint and args.load and not holds_checkpoint(args.load):
        _fail(f"--exit-on-missing-checkpoint: --load {args.load} holds no checkpoint (no folder with a "
              f"meta.json); give the folder --save wrote, or drop the flag to start from scratch")
    zero_stage = args.zero_stage
    if args.use_distributed_optimizer:
        if zero_stage is None:
            zero_stage = 1
            logger.info("--use-distributed-optimizer: megazoo's ZeRO-1 (optimizer state and fp32 master "
                        "weights sharded over data parallelism; --zero-stage 2/3 shard more)")
        else:
            logger.info("--use-distributed-optimizer: --zero-stage %d given, which decides", zero_stage)
    return Compat(zero_stage=zero_stage or 0, eod_mask_token=eod_token if args.eod_mask_loss else None)


def holds_checkpoint(load: str) -> bool:
    """Whether a --load folder is, or holds, a saved iteration (a folder with its meta.json); the
    resume itself (training/checkpoint/resume.py) then picks and verifies one."""
    if os.path.isfile(os.path.join(load, "meta.json")):
        return True
    return os.path.isdir(load) and any(os.path.isfile(os.path.join(load, name, "meta.json"))
                                       for name in os.listdir(load))


def vocab_multiple(args) -> int | None:
    """--make-vocab-size-divisible-by that pads to exactly --pad-vocab-size-to rows at this tp."""
    n, tp = args.pad_vocab_size_to, args.tensor_model_parallel_size
    if n is None:
        return args.make_vocab_size_divisible_by
    if n % tp:
        _fail(f"--pad-vocab-size-to {n} must be divisible by --tensor-model-parallel-size {tp}")
    if args.make_vocab_size_divisible_by and n % args.make_vocab_size_divisible_by:
        _fail(f"--pad-vocab-size-to {n} must be divisible by --make-vocab-size-divisible-by "
              f"{args.make_vocab_size_divisible_by}")
    return n // tp


def check_model(args, model) -> None:
    """The compatibility flags that depend on the model a preset and the flags made."""
    length = getattr(args, "moe_layer_pattern_length", None)
    if length is not None and length != model.num_layers:
        _fail(f"--moe-layer-freq lists {length} layers, the model has {model.num_layers} (--num-layers)")
    if args.no_position_embedding and model.position_embedding == "learned":
        _fail("--no-position-embedding leaves no positions: megazoo needs --position-embedding-type "
              "rope or alibi with it")
    if args.pad_vocab_size_to is not None and model.vocab_size > args.pad_vocab_size_to:
        _fail(f"--pad-vocab-size-to {args.pad_vocab_size_to} is smaller than the vocabulary "
              f"({model.vocab_size})")


def stage_layers(args, num_layers: int) -> tuple[int | None, int | None]:
    """--decoder-first/last-pipeline-num-layers, or what --pp-partition-method asks for."""
    first, last, method = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                           args.pp_partition_method)
    pp = args.pipeline_model_parallel_size
    if method is None or pp == 1:
        return first, last
    kinds = set(method.removeprefix("type:").lower().split("|")) if method.startswith("type:") else None
    if kinds == {"transformer"}:
        return first, last  # transformer layers split evenly: megazoo's default
    if kinds != {"transformer", "embedding"}:
        _fail(f"--pp-partition-method {method}: megazoo partitions by layer count: give "
              f"'type:transformer' or 'type:transformer|embedding' (or --decoder-first/last-pipeline-num-layers)")
    if first is not None or last is not None:
        _fail("give one of --pp-partition-method and --decoder-first/last-pipeline-num-layers")
    units = num_layers + 2  # the tied embedding counts as a layer on the first and on the last stage
    if units % pp:
        _fail(f"--pp-partition-method {method}: {num_layers} layers + 2 embeddings do not split evenly "
              f"over {pp} stages; give --decoder-first/last-pipeline-num-layers instead")
    per_stage = units // pp
    logger.info("--pp-partition-method %s: %d layers on the first and last stages, %d on the others "
                "(--decoder-first/last-pipeline-num-layers %d)", method, per_stage - 1, per_stage,
                per_stage - 1)
    return per_stage - 1, per_stage - 1


def samples_to_iterations(args, gbs: int) -> int | None:
    """--lr-decay-samples as iterations at the full global batch (as --lr-warmup-samples)."""
    counts = [f for f in ("train_samples", "lr_warmup_samples", "lr_decay_samples") if getattr(args, f)]
    if args.rampup_batch_size and counts:
        logger.info("%s: turned into iterations at the full global batch %d; the smaller batches of "
                    "--rampup-batch-size make them end at fewer samples than in Megatron",
                    ", ".join("--" + f.replace("_", "-") for f in counts), gbs)
    if args.lr_decay_samples is None:
        return args.lr_decay_iters
    return -(-args.lr_decay_samples // gbs)
