"""The --dpo* flags (TRL's DPOConfig names: beta, loss_type, label_smoothing) and the
DPOSettings they make (training/run/dpo.py computes the loss)."""
from __future__ import annotations

import argparse

from megazoo.training.config.run_config import DPOSettings

LOSS_TYPES = ("sigmoid", "robust", "ipo")


def add_dpo_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DPO (docs/post_training.md)")
    g.add_argument("--dpo", action="store_true",
                   help="direct preference optimisation: --data-path is a prefix from "
                        "tools/preprocess_dpo.py; the reference is the base with the adapters off "
                        "(--lora-rank) or a frozen copy of --load's checkpoint (--finetune) or of "
                        "--dpo-reference")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="beta: the KL strength")
    g.add_argument("--dpo-loss-type", choices=LOSS_TYPES, default="sigmoid",
                   help="sigmoid (DPO), robust (with --dpo-label-smoothing) or ipo (mean log "
                        "ratios per reply token), as TRL's loss_type")
    g.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="robust: the assumed share of flipped labels, in [0, 0.5)")
    g.add_argument("--dpo-reference", metavar="DIR",
                   help="without LoRA: the reference model's checkpoint (default: --load with "
                        "--finetune)")


def dpo_settings(args: argparse.Namespace, parallel, lora) -> DPOSettings | None:
    """The run's DPOSettings, or None without --dpo; raises ValueError naming the flag."""
    given = [f for f in ("dpo_reference",) if getattr(args, f)]
    if not args.dpo:
        if given or args.dpo_loss_type != "sigmoid" or args.dpo_label_smoothing or args.dpo_beta != 0.1:
            raise ValueError("--dpo-* flags need --dpo")
        return None
    if args.sft or args.sft_packing:
        raise ValueError("--dpo and --sft exclude each other: --data-path is one kind of set")
    if args.mock_data or len(args.data_path) != 1:
        raise ValueError("--dpo needs one --data-path PREFIX (the --output-prefix of "
                         "tools/preprocess_dpo.py)")
    if parallel.pp > 1 or parallel.cp > 1:
        raise ValueError("--dpo runs with --pipeline-model-parallel-size 1 and "
                         "--context-parallel-size 1 (a pair's sequences and the reference forward "
                         "stay on one stage)")
    if args.micro_batch_size % 2:
        raise ValueError(f"--dpo: --micro-batch-size {args.micro_batch_size} must be even (a "
                         f"microbatch holds whole pairs: chosen, rejected)")
    if args.dpo_beta <= 0:
        raise ValueError(f"--dpo-beta must be > 0, got {args.dpo_beta}")
    if args.dpo_loss_type == "robust" and not 0.0 <= args.dpo_label_smoothing < 0.5:
        raise ValueError(f"--dpo-label-smoothing must be in [0, 0.5), got {args.dpo_label_smoothing}")
    if args.dpo_loss_type != "robust" and args.dpo_label_smoothing:
        raise ValueError(f"--dpo-label-smoothing is used by --dpo-loss-type robust only (TRL's "
                         f"{args.dpo_loss_type} ignores it); drop it or choose robust")
    reference = args.dpo_reference
    if lora is not None and reference:
        raise ValueError("--dpo-reference with LoRA: the reference is the base with the adapters "
                         "off; drop --dpo-reference")
    if lora is None and not reference:
        if not (args.load and args.finetune):
            raise ValueError("--dpo without LoRA needs its reference model: --load CKPT "
                             "--finetune (the start is the reference) or --dpo-reference CKPT")
        reference = args.load
    return DPOSettings(beta=args.dpo_beta, loss_type=args.dpo_loss_type,
                       label_smoothing=args.dpo_label_smoothing, reference=reference)
