"""Megatron-LM and Megatron-DeepSpeed flags beyond the core set, so their launch scripts run unchanged.

Every flag here is honoured, mapped onto megazoo's equivalent, accepted with one log line saying what
megazoo does instead, or refused in one line saying why and what to give. The refusals of a command
line are collected and raised together (`translate`, called by the parser before any work), with the
flags argparse does not know. docs/megatron.md has the table.

Implemented where the config they set is read: --exit-interval, --exit-duration-in-mins
(training/run/stop.py), --no-load-optim, --no-load-rng (training/checkpoint/resume.py), --eod-mask-loss
(training/run/batches.py, training/run/step.py), --num-workers (training/run/batches.py), --log-throughput
(training/monitor/console.py), --tokenizer-type NullTokenizer (data/tokenizers.py),
--exit-on-missing-checkpoint (megatron_resolve.py, before anything starts). The checks that
need the model or the layout (`resolve_megatron_compat`, `vocab_multiple`, `check_model`, `stage_layers`,
`samples_to_iterations`): training/config/megatron_resolve.py, re-exported here.
"""
from __future__ import annotations

import argparse
import logging
import os

from megazoo.training.config.data_sources import per_split_given, resolve_data_sources
from megazoo.training.config.deepspeed_config import DeepSpeedConfigError, contradictions, read_deepspeed_config
from megazoo.training.config.megatron_resolve import (  # noqa: F401 - re-exported
    Compat, check_model, resolve_megatron_compat, samples_to_iterations, stage_layers, vocab_multiple)
from megazoo.training.config.megatron_table import ACCEPTED, ALIASES, MAPPED, REFUSED
from megazoo.training.config.validation_flags import validation_refusals
from megazoo.training.config.weighted_split_paths import WeightedSplitError, to_data_path_and_split

logger = logging.getLogger("megazoo.train")


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
    for flag, (kwargs, why) in MAPPED.items():
        g.add_argument(flag, *ALIASES.get(flag, ()), help=why, **kwargs)
    for flag, (kwargs, why) in ACCEPTED.items():
        g.add_argument(flag, *ALIASES.get(flag, ()),
                       help="accepted: " + (why or "ZeRO-1 here, unless --zero-stage is given"), **kwargs)
    g = p.add_argument_group("refused Megatron-LM flags (each says why)")
    for flag, (kwargs, why) in REFUSED.items():
        g.add_argument(flag, *ALIASES.get(flag, ()), help="refused: " + why, **kwargs)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


class Notes:
    """Log lines held back until the whole command line is accepted: a refused one logs nothing."""

    def __init__(self):
        self.lines = []

    def info(self, fmt: str, *args) -> None:
        self.lines.append((fmt, args))

    def emit(self) -> None:
        for fmt, args in self.lines:
            logger.info(fmt, *args)


def translate(args: argparse.Namespace, given: set[str], flag_of) -> tuple[list[str], Notes]:
    """Map the foreign flags onto megazoo's; return the refusals and the accepted flags' log lines.

    `given`: the dests the command line sets; `flag_of`: dest -> its flag (for messages)."""
    notes = Notes()
    refused = [f"{flag}{_shown(getattr(args, _dest(flag)))}: {why}"
               for flag, (_, why) in REFUSED.items() if _dest(flag) in given]
    for flag, (_, why) in ACCEPTED.items():
        if why and _dest(flag) in given:
            notes.info("%s: %s", flag, why)
    if args.optimizer == "adam":  # before the DeepSpeed file, whose Adam is AdamW too
        args.optimizer = "adamw"
        notes.info("--optimizer adam: AdamW (Megatron's adam decouples the weight decay, as AdamW)")
    refused += _deepspeed(args, given, flag_of, notes)
    refused += _data(args, given, notes)
    refused += validation_refusals(args, given)
    refused += _model_and_training(args, given, notes)
    return refused, notes


def _shown(value) -> str:
    """A flag's value as the command line gave it (nothing for a switch)."""
    if value is True:
        return ""
    return " " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))


def _deepspeed(args, given, flag_of, notes) -> list[str]:
    if args.deepspeed_config is None:
        return []
    if not args.deepspeed:
        return [f"--deepspeed_config {args.deepspeed_config}: Megatron-DeepSpeed reads it only with "
                f"--deepspeed; add --deepspeed or drop the file"]
    try:
        settings = read_deepspeed_config(args.deepspeed_config)
    except DeepSpeedConfigError as e:
        return [str(e)]
    for line in settings.accepted:
        notes.info("%s", line)
    args.gradient_accumulation_steps = settings.gradient_accumulation_steps
    return settings.refused + contradictions(settings, args, given, flag_of)


def _data(args, given, notes) -> list[str]:
    refused = []
    if args.tokenizer_type == "PretrainedFromHF":
        path = args.tokenizer_name_or_path
        if not path:
            refused.append("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path")
        elif not os.path.isdir(path):
            refused.append(f"--tokenizer-name-or-path {path}: megazoo reads a local tokenizer folder and "
                           f"downloads nothing; download it (huggingface-cli download {path} --local-dir "
                           f"DIR) and give DIR")
        elif args.tokenizer_model and args.tokenizer_model != path:
            refused.append(f"--tokenizer-model {args.tokenizer_model} contradicts "
                           f"--tokenizer-name-or-path {path}; give one")
        else:
            args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", path
    elif args.tokenizer_name_or_path:
        refused.append(f"--tokenizer-name-or-path applies to --tokenizer-type PretrainedFromHF only; "
                       f"with {args.tokenizer_type} give --tokenizer-model")
    files = {split: (f"--{split}-weighted-split-paths-path", getattr(args, f"{split}_weighted_split_paths_path"))
             for split in ("train", "valid", "test")}
    files = {k: v for k, v in files.items() if v[1]}
    refused += resolve_data_sources(args, given, notes)
    if files:
        if per_split_given(args):
            refused.append("--train/valid/test-data-path and --*-weighted-split-paths-path are two ways to "
                           "name the splits; give one")
        elif args.data_path or "split" in given:
            refused.append("--data-path/--split and --*-weighted-split-paths-path are two ways to name the "
                           "data (Megatron-DeepSpeed refuses both together too); give one")
        else:
            try:
                args.data_path, args.split = to_data_path_and_split(files)
                notes.info("weighted split paths: --data-path %s --split %s", " ".join(args.data_path),
                           args.split)
            except WeightedSplitError as e:
                refused.append(str(e))
    if args.data_impl not in (None, "mmap", "infer"):
        refused.append(f"--data-impl {args.data_impl}: megazoo reads the mmap .bin/.idx format only; "
                       f"preprocess with tools/preprocess_data.py (or Megatron's, --dataset-impl mmap)")
    if args.valid_num_workers:
        notes.info("--valid-num-workers %d: megazoo reads validation batches in the step",
                   args.valid_num_workers)
    return refused


def _recompute_shorthand(args, flag: str, granularity: str, refused: list[str]) -> bool:
    """`flag` stands for --recompute-granularity `granularity`: set it, or refuse `flag` when
    another granularity was given (False)."""
    if args.recompute_granularity not in (None, granularity):
        refused.append(f"{flag} ({granularity} recompute) contradicts --recompute-granularity "
                       f"{args.recompute_granularity}; give one")
        return False
    args.recompute_granularity = granularity
    return True


def _model_and_training(args, given, notes) -> list[str]:
    refused = []
    if args.checkpoint_activations:
        if _recompute_shorthand(args, "--checkpoint-activations", "full", refused):
            args.recompute_method = args.recompute_method or "uniform"
            args.recompute_num_layers = args.recompute_num_layers or args.checkpoint_num_layers or 1
            notes.info("--checkpoint-activations: --recompute-granularity full --recompute-method %s "
                       "--recompute-num-layers %d", args.recompute_method, args.recompute_num_layers)
    elif args.checkpoint_num_layers is not None:
        refused.append("--checkpoint-num-layers needs --checkpoint-activations")
    if args.lr_decay_samples is not None and args.lr_decay_iters is not None:
        refused.append("give one of --lr-decay-samples and --lr-decay-iters")
    if args.distributed_timeout_minutes is not None:
        if "collective_timeout" in given:
            notes.info("--distributed-timeout-minutes: --collective-timeout %g s decides",
                       args.collective_timeout)
        else:
            args.collective_timeout = 60.0 * args.distributed_timeout_minutes
            notes.info("--distributed-timeout-minutes %g: --collective-timeout %g s (a collective that "
                       "waits longer ends the job naming the ranks that did not arrive)",
                       args.distributed_timeout_minutes, args.collective_timeout)
    if args.grad_reduce_in_bf16 and not args.bf16:
        refused.append("--grad-reduce-in-bf16 needs --bf16")
    if args.apply_layernorm_1p:
        notes.info("--apply-layernorm-1p: megazoo stores the norm weight g itself, Megatron g - 1; "
                   "the function is the same and, norms having no weight decay, so are the updates")
    if args.rotary_percent is not None and args.rotary_percent != 1.0:
        refused.append(f"--rotary-percent {args.rotary_percent}: partial rotary embeddings are not "
                       f"implemented; RoPE rotates the whole head (1.0)")
    balancing = args.moe_router_load_balancing_type
    if balancing == "none":
        args.moe_aux_loss_coeff, args.moe_router_load_balancing_type = 0.0, None
        notes.info("--moe-router-load-balancing-type none: --moe-aux-loss-coeff 0")
    elif balancing not in (None, "aux_loss", "seq_aux_loss"):
        refused.append(f"--moe-router-load-balancing-type {balancing}: megazoo balances with the "
                       f"Switch/GShard auxiliary loss, per batch or per sequence; use aux_loss, "
                       f"seq_aux_loss (--moe-aux-loss-coeff) or none")
    dispatcher = args.moe_token_dispatcher_type
    if dispatcher in ("allgather", "flex"):
        notes.info("--moe-token-dispatcher-type %s: megazoo dispatches with all-to-all over the "
                   "expert-parallel group; each expert sees the same tokens", dispatcher)
    elif dispatcher not in (None, "alltoall"):
        refused.append(f"--moe-token-dispatcher-type {dispatcher}: not a Megatron dispatcher; megazoo's "
                       f"is alltoall")
    refused += _megatron_lm(args, notes)
    if args.ckpt_format is not None:
        notes.info("--ckpt-format %s: megazoo saves its own format (safetensors, any layout loads "
                   "into any other); tools/convert_checkpoint.py converts Megatron-LM checkpoints to "
                   "and from it (docs/megatron.md)", args.ckpt_format)
    return refused + _moe(args, notes) + _sharding(args, given, notes)


def _megatron_lm(args, notes) -> list[str]:
    """Megatron-LM's everyday switches: selective recompute, squared ReLU, the loader, weight decay."""
    refused = []
    if args.recompute_activations:
        if _recompute_shorthand(args, "--recompute-activations", "selective", refused):
            notes.info("--recompute-activations: --recompute-granularity selective (the attention "
                       "core is recomputed in backward)")
    if args.squared_relu and args.swiglu:
        refused.append("--squared-relu contradicts --swiglu (Megatron-LM refuses both too); give one")
    if args.dataloader_type == "cyclic":
        refused.append("--dataloader-type cyclic: megazoo walks the samples once in Megatron's shuffled "
                       "order (single); a new random order per pass is not implemented; give single")
    elif args.dataloader_type == "external":
        refused.append("--dataloader-type external: megazoo builds its loader from --data-path (or "
                       "--mock-data); give single")
    if args.weight_decay_incr_style not in (None, "constant"):
        refused.append(f"--weight-decay-incr-style {args.weight_decay_incr_style}: a weight-decay "
                       f"schedule is not implemented; give constant (--weight-decay throughout)")
    if args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16:
        refused.append("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16; give one")
    if args.exit_on_missing_checkpoint and not args.load:
        notes.info("--exit-on-missing-checkpoint without --load: no checkpoint to look for")
    return refused


def _moe(args, notes) -> list[str]:
    refused = []
    if args.moe_layer_freq is not None:
        try:
            args.moe_layer_freq, args.moe_layer_pattern_length, first_dense = \
                moe_layer_freq(args.moe_layer_freq)
            if first_dense:
                args.moe_first_dense_layers = first_dense
        except ValueError as e:
            refused.append(f"--moe-layer-freq {args.moe_layer_freq}: {e}")
            args.moe_layer_freq = None
    if args.moe_router_score_function == "sigmoid" and args.moe_router_pre_softmax:
        args.moe_router_pre_softmax = None  # Megatron applies it to softmax scores only
        notes.info("--moe-router-pre-softmax with --moe-router-score-function sigmoid: ignored, as "
                   "Megatron-LM does (it orders the softmax only)")
    if args.moe_router_dtype not in (None, "fp32"):
        notes.info("--moe-router-dtype %s: megazoo's router computes in fp32", args.moe_router_dtype)
    if args.expert_tensor_parallel_size not in (None, 1):
        refused.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: megazoo's "
                       f"experts are whole on each tensor-parallel rank (1); split them with "
                       f"--expert-model-parallel-size")
    if args.lr_warmup_init:
        refused.append(f"--lr-warmup-init {args.lr_warmup_init}: megazoo's warmup starts from 0; drop it")
    if args.recompute_modules is not None and args.recompute_modules != ["core_attn"]:
        refused.append(f"--recompute-modules {' '.join(args.recompute_modules)}: megazoo's selective "
                       f"recompute is the attention core (core_attn) only; --recompute-granularity full "
                       f"recomputes whole layers")
    return refused


def moe_layer_freq(text: str) -> tuple[int, int | None, int]:
    """Megatron's --moe-layer-freq: N, or a per-layer list such as "[1,0]*4" or "[0]*3+[1]*58"
    (1: MoE), read without eval; a list must be megazoo's shape: K dense layers first (DeepSeek's
    first_k_dense_replace), then MoE at every N-th layer. Returns N, the list's length (None for
    N) and K."""
    if text.strip().isdigit():
        return int(text), None, 0
    pattern = []
    for term in text.replace(" ", "").split("+"):
        items, _, times = term.partition("*")
        if not (items.startswith("[") and items.endswith("]")) or (times and not times.isdigit()):
            raise ValueError("give N or a list like [1,0]*4")
        values = [int(v) for v in items[1:-1].split(",") if v]
        pattern += values * (int(times) if times else 1)
    first = next((i for i, v in enumerate(pattern) if v), len(pattern))
    rest = pattern[first:]
    for n in range(1, len(rest) + 1):
        if rest == [int(i % n == 0) for i in range(len(rest))]:
            if first and n > 1:  # megazoo's layer i is MoE when i % N == 0, counted from 0
                break
            return n, len(pattern), first
    raise ValueError("megazoo puts experts in every N-th layer from layer 0, or in every layer after "
                     "K dense ones (--moe-layer-freq N, --moe-first-dense-layers K); other per-layer "
                     "patterns are not implemented")


_FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _sharding(args, given, notes) -> list[str]:
    refused = []
    strategy = args.data_parallel_sharding_strategy
    if args.use_megatron_fsdp:
        stage = _FSDP_STAGES.get(strategy or "optim_grads_params")
        if stage is None:
            refused.append(f"--data-parallel-sharding-strategy {strategy}: give one of {', '.join(_FSDP_STAGES)}")
        elif "zero_stage" in given and args.zero_stage != stage:
            refused.append(f"--zero-stage {args.zero_stage} contradicts --use-megatron-fsdp "
                           f"--data-parallel-sharding-strategy {strategy} (ZeRO-{stage}); give one")
        else:
            args.zero_stage = stage
            notes.info("--use-megatron-fsdp: megazoo's ZeRO-%d (--zero-stage %d)", stage, stage)
    elif strategy is not None:
        refused.append("--data-parallel-sharding-strategy needs --use-megatron-fsdp (or give --zero-stage)")
    dtypes = {args.megatron_fsdp_grad_comm_dtype, args.megatron_fsdp_main_grads_dtype} - {None}
    if dtypes == {"bf16"}:
        args.grad_reduce_in_bf16 = True
        notes.info("--megatron-fsdp-grad-comm-dtype/--megatron-fsdp-main-grads-dtype bf16: "
                   "--grad-reduce-in-bf16")
    elif dtypes - {"fp32"}:
        refused.append(f"--megatron-fsdp-grad-comm-dtype/--megatron-fsdp-main-grads-dtype "
                       f"{'/'.join(sorted(dtypes))}: megazoo accumulates and reduces gradients in one "
                       f"dtype, fp32 or (with --bf16) bf16")
    return refused
