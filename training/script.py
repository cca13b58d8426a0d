"""What every reference script shares: parse flags, build the tokenizer, run `pretrain`."""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from .arguments import ArgumentError, build_parser, to_run_config
from .loop import pretrain


def tokenizer_vocab_size(args) -> int | None:
    if args.mock_data and not (args.vocab_file or args.tokenizer_model):
        return None
    from data.tokenizers import build_tokenizer
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model).vocab_size


def main(model_provider, default_model: str, argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one voice: rank 0 logs, others warn
    args = build_parser(default_model).parse_args(argv)
    try:
        run = to_run_config(args, vocab_size=tokenizer_vocab_size(args))
    except (ArgumentError, ValueError) as e:
        sys.exit(f"error: {e}")
    result = pretrain(model_provider, run)
    if dist.is_initialized():  # leave together: a gloo rank torn down while a peer is still
        dist.barrier()         # connected aborts ("terminate called without an active exception")
        dist.destroy_process_group()
    if result.checkpoint and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("megazoo.train").info(
            "checkpoint: %s  (resume: add --load %s to the same command)", result.checkpoint,
            run.checkpoint.save)
    return result
