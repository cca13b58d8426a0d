"""Megatron-LM and Megatron-DeepSpeed flags beyond the core set, so their launch scripts run unchanged.

Every flag here is honoured, mapped onto megazoo's equivalent, accepted with one log line saying what
megazoo does instead, or refused in one line saying why and what to give. The refusals of a command
line are collected and raised together (`translate`, called by the parser before any work), with the
flags argparse does not know. docs/megatron.md has the table.

Implemented where the config they set is read: --exit-interval, --exit-duration-in-mins
(training/run/stop.py), --no-load-optim, --no-load-rng (training/checkpoint/resume.py), --eod-mask-loss
(training/run/batches.py, training/run/step.py), --num-workers (training/run/batches.py), --log-throughput
(training/monitor/console.py), --tokenizer-type NullTokenizer (data/tokenizers.py).
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from megazoo.training.config.deepspeed_config import DeepSpeedConfigError, contradictions, read_deepspeed_config
from megazoo.training.config.errors import ArgumentError
from megazoo.training.config.megatron_table import ACCEPTED, MAPPED, REFUSED
from megazoo.training.config.weighted_split_paths import WeightedSplitError, to_data_path_and_split

logger = logging.getLogger("megazoo.train")


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
    for flag, (kwargs, why) in MAPPED.items():
        g.add_argument(flag, help=why, **kwargs)
    for flag, (kwargs, why) in ACCEPTED.items():
        g.add_argument(flag, help="accepted: " + (why or "ZeRO-1 here, unless --zero-stage is given"),
                       **kwargs)
    g = p.add_argument_group("refused Megatron-LM flags (each says why)")
    for flag, (kwargs, why) in REFUSED.items():
        g.add_argument(flag, help="refused: " + why, **kwargs)


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
    if files:
        if args.data_path or "split" in given:
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


def _model_and_training(args, given, notes) -> list[str]:
    refused = []
    if args.checkpoint_activations:
        if args.recompute_granularity not in (None, "full"):
            refused.append(f"--checkpoint-activations (full recompute) contradicts --recompute-granularity "
                           f"{args.recompute_granularity}; give one")
        else:
            args.recompute_granularity = "full"
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
    if args.ckpt_format is not None:
        notes.info("--ckpt-format %s: megazoo saves its own format (safetensors, any layout loads "
                   "into any other); tools/convert_checkpoint.py converts Megatron-LM checkpoints to "
                   "and from it (docs/megatron.md)", args.ckpt_format)
    return refused + _moe(args, notes) + _sharding(args, given, notes)


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
    zero_stage = args.zero_stage
    if args.use_distributed_optimizer:
        if zero_stage is None:
            zero_stage = 1
            logger.info("--use-distributed-optimizer: megazoo's ZeRO-1 (optimizer state and fp32 master "
                        "weights sharded over data parallelism; --zero-stage 2/3 shard more)")
        else:
            logger.info("--use-distributed-optimizer: --zero-stage %d given, which decides", zero_stage)
    return Compat(zero_stage=zero_stage or 0, eod_mask_token=eod_token if args.eod_mask_loss else None)


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
