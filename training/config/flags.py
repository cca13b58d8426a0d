"""Megatron-LM flag names, mapped onto the typed configs in one place, validated at start (the
flags themselves: training/config/parser.py).

A preset (`--model gpt2-medium`) fills the model shape; any individual model flag overrides it.
Inconsistent values fail before any process group or weight exists, with one clear line.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os

from megazoo.data.blended import check_blend
from megazoo.models.config import TransformerConfig
from megazoo.models.family_rules import DENSE_FAMILIES, MIXED_FAMILIES, MOE_FAMILIES, problem
from megazoo.models.presets import PRESETS, preset
from megazoo.parallel.context_parallel import check_attention
from megazoo.parallel.layout import LayoutError, microbatches_per_step
from megazoo.parallel.zero.config import LossScaleConfig, OptimizerConfig

from megazoo.training.config.data_sources import per_split_given
from megazoo.training.config.errors import ArgumentError
from megazoo.training.config.layout_flags import parallel_config_of
from megazoo.training.config.dpo_flags import dpo_settings
from megazoo.training.config.grpo_flags import grpo_settings
from megazoo.training.config.lora_flags import lora_settings
from megazoo.training.config.muon_flags import muon_settings, qk_clip_settings
from megazoo.training.config.megatron_resolve import (check_model, resolve_megatron_compat, samples_to_iterations,
                                                    stage_layers, vocab_multiple)
from megazoo.training.config.run_config import (CheckpointConfig, DataConfig, HealthConfig, LoggingConfig, RunConfig,
                                        ScheduleConfig)

logger = logging.getLogger(__name__)
# TransformerConfig.params_dtype -> the flag that asks for it (--bf16, --fp16; float32: neither)
DTYPE_FLAGS = {"bfloat16": "bf16", "float16": "fp16"}


def _check_eval_tasks(args: argparse.Namespace) -> None:
    tasks = getattr(args, "eval_tasks", None)
    if not tasks:
        if getattr(args, "eval_tasks_interval", 0) or getattr(args, "eval_tasks_limit", None):
            _fail("--eval-tasks-interval/--eval-tasks-limit without --eval-tasks: name the tasks")
        return
    for spec in tasks:
        if spec.endswith((".yaml", ".yml")) and not os.path.isfile(spec):
            _fail(f"--eval-tasks: {spec}: no such task file; give an lm-eval task name or the path "
                  f"of a task YAML file")
    if args.mock_data and not (args.vocab_file or args.tokenizer_model) and \
            args.tokenizer_type != "NullTokenizer":
        _fail("--eval-tasks needs the run's tokenizer: give --vocab-file/--merge-file or "
              "--tokenizer-model (mock data has none)")
    if getattr(args, "context_parallel_size", 1) > 1:
        _fail("--eval-tasks runs at --context-parallel-size 1; drop --eval-tasks or evaluate the "
              "checkpoints with megazoo-lm-eval")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        _fail("--eval-tasks needs lm-evaluation-harness: pip install 'megazoo[eval]'")


def validate_values(args: argparse.Namespace) -> None:
    """Values that are wrong on their own (whatever the other flags), refused in one line."""
    positive = ("micro_batch_size", "global_batch_size", "train_iters", "train_samples",
                "log_interval", "save_interval", "keep_last", "keep_every", "max_bad_steps",
                "seq_length", "num_layers", "hidden_size", "num_attention_heads",
                "eval_tasks_limit", "eval_tasks_batch_size")
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check_eval_tasks(args)
    for name in ("eval_interval", "eval_tasks_interval", "eval_iters", "lr_warmup_iters", "lr_decay_iters", "zero_stage"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            _fail(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "collective_timeout",
                 "initial_loss_scale", "min_loss_scale", "hidden_dropout", "attention_dropout"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            _fail(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    for flag, path in (("--save", args.save), ("--load", args.load)):
        blocker = _file_in_the_way(path)
        if blocker:
            _fail(f"{flag} {path}: {blocker} is a file, not a folder; give {flag} a folder")
    if args.keep_every and not args.keep_last:
        _fail("--keep-every K only refines --keep-last N; give --keep-last too")
    if args.async_save and not args.save:
        _fail("--async-save writes the checkpoints of --save in the background; give --save DIR")
    try:
        check_blend(args.data_path)
    except ValueError as e:
        _fail(str(e))


def _fail(msg: str):
    raise ArgumentError(msg)


def _file_in_the_way(path: str | None) -> str | None:
    """The existing file at `path` or above it (where a folder must be), else None."""
    probe = os.path.abspath(path) if path else None
    while probe:
        if os.path.exists(probe):
            return None if os.path.isdir(probe) else probe
        parent = os.path.dirname(probe)
        probe = None if parent == probe else parent
    return None


def _warn(msg: str) -> None:
    """One line from rank 0 (every rank parses the same flags)."""
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning("%s", msg)


def check_warmup(warmup: int, decay_iters: int | None, train_iters: int, lr: float) -> None:
    """A warmup longer than an explicit --lr-decay-iters is refused (Megatron's scheduler asserts
    warmup < decay steps; megazoo accepts warmup = decay: the LR reaches --lr on the last warmup
    step). A warmup longer than this run, with the decay defaulting to --train-iters, is one
    warning with the LR the run reaches: Megatron refuses that too, megazoo lets short smoke runs
    of a real schedule through but says so."""
    if decay_iters is not None and warmup > decay_iters:
        _fail(f"LR warmup of {warmup} iterations exceeds --lr-decay-iters {decay_iters}; shorten "
              f"--lr-warmup-iters/-samples/-fraction or lengthen the decay")
    if warmup > train_iters:
        beyond = "" if decay_iters else " (and the decay, which defaults to --train-iters)"
        _warn(f"LR warmup of {warmup} iterations outlasts --train-iters {train_iters}{beyond}: this "
              f"run's LR reaches only {lr * train_iters / warmup:.3g} of --lr {lr:g}; shorten "
              f"--lr-warmup-iters" + ("" if decay_iters else " or give --lr-decay-iters"))


def _preset_with_flags(name: str, overrides: dict) -> TransformerConfig:
    """The preset with the flags applied. Flags that make the model another family than the
    preset's (--qk-layernorm on moe-tiny: a Qwen3-MoE) give it that family, logged; flags that
    fit no family are refused in one line naming the field (a field no family could take, e.g.
    an out-of-range value, is refused by its own check)."""
    try:
        return preset(name, **overrides)
    except ValueError as refused:
        try:
            model = preset(name, **overrides, family=None)  # the family the fields make
        except ValueError as invalid:  # the fields are wrong whatever the family
            raise invalid from None
        if model.family is None:  # say why each family of its kind does not fit
            order = MOE_FAMILIES + MIXED_FAMILIES if model.num_experts else DENSE_FAMILIES
            raise ValueError(f"--model {name} with these flags fits no model family: "
                             + "; ".join(problem(model, f) for f in order)) from refused
    logger.info("--model %s is family %r; with these flags the model is family %r",
                name, PRESETS[name].get("family"), model.family)
    return model


# How a run computes, not what: the command line's (or the default), never a checkpoint's
RUN_SETTINGS = ("params_dtype", "recompute_granularity", "recompute_method", "recompute_num_layers")


def _loaded_with_flags(loaded: TransformerConfig, overrides: dict, args,
                       tokenizer_vocab: bool) -> TransformerConfig:
    """--load's model (the whole config its checkpoint records: family, sizes, rope, norms ...)
    with the flags given applied. Training settings may change (dropout, aux losses, ...); a flag
    that changes what the weights compute is refused, naming both values."""
    run = {k: overrides.get(k, getattr(TransformerConfig, k)) for k in RUN_SETTINGS}
    try:
        model = loaded.replace(**{**overrides, **run})
    except ValueError as e:
        _fail(f"--load {args.load}: the checkpoint's model with these flags: {e}")
    saved, here = loaded.computed_fields(), model.computed_fields()
    for k in dict.fromkeys([*saved, *here]):
        if saved.get(k) != here.get(k):
            fix = "the tokenizer's vocabulary: give the tokenizer it was trained with" \
                if k == "vocab_size" and tokenizer_vocab else \
                "drop the flag (the checkpoint gives the model's shape)"
            _fail(f"--load {args.load} holds another model: {k}={saved.get(k)!r} there, "
                  f"{here.get(k)!r} here; {fix}")
    if args.model and "model" in (getattr(args, "given_flags", None) or ()):
        logger.info("--use-checkpoint-args: the model is --load's, not --model %s", args.model)
    logger.info("--load %s: the model from its checkpoint (family %r, %d layers, hidden size %d)",
                args.load, model.family, model.num_layers, model.hidden_size)
    return model


def to_run_config(args: argparse.Namespace, vocab_size: int | None = None,
                  world_size: int | None = None, eod_token: int | None = None,
                  loaded: TransformerConfig | None = None, pad_mask_token: int | None = None) -> RunConfig:
    """Map parsed flags onto the configs and check that they fit together, one config at a time.

    `vocab_size` and `eod_token` come from the tokenizer when there is one (training/run/entry.py).
    `loaded`: the model config --load's checkpoint records (training/run/entry.py), which is the
    model when --model is not given (or --use-checkpoint-args is)."""
    validate_values(args)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    compat = resolve_megatron_compat(args, eod_token)
    model, seq = model_config(args, vocab_size, loaded)
    parallel, dp, gbs = layout_config(args, model, seq, world)
    optimizer = optimizer_config(args, model, parallel, compat)
    try:
        lora = lora_settings(args, model, parallel.tp)
        dpo = dpo_settings(args, parallel, lora)
        grpo = grpo_settings(args, parallel, lora, optimizer.zero_stage)
    except ValueError as e:
        _fail(str(e))
    schedule = schedule_config(args, parallel, dp, gbs)
    if vocab_size and args.vocab_size and args.tokenizer_type not in ("NullTokenizer",) \
            and args.vocab_size != vocab_size:
        _warn(f"--vocab-size {args.vocab_size} ignored: the tokenizer gives the vocabulary "
              f"({vocab_size} tokens, padded by --make-vocab-size-divisible-by); drop the flag")
    if args.compile_backend and not args.compile:
        _fail(f"--compile-backend {args.compile_backend} chooses how --compile compiles; add --compile")
    return RunConfig(
        compile_backend=(args.compile_backend or "inductor") if args.compile else None,
        model=model, parallel=parallel, optimizer=optimizer,
        seed=args.seed, health=health_config(args), schedule=schedule, lora=lora, dpo=dpo, grpo=grpo,
        data=data_config(args, seq, compat, eod_token, pad_mask_token),
        checkpoint=from_flags(CheckpointConfig, args, load_optim=not args.no_load_optim,
                              load_rng=not args.no_load_rng),
        logging=from_flags(LoggingConfig, args, eval_tasks=tuple(args.eval_tasks)))


def from_flags(cls, args: argparse.Namespace, **computed):
    """A config whose fields are flags of the same name (--keep-last -> keep_last), except those
    `computed` gives."""
    return cls(**{f.name: computed[f.name] if f.name in computed else getattr(args, f.name)
                  for f in dataclasses.fields(cls)})


def model_config(args, vocab_size: int | None, loaded: TransformerConfig | None):
    """(the model, the sequence length): the preset, --load's model or the flags alone, with the
    model flags applied (module docstring), and the model checks that need the other flags."""
    # Model flags named as their TransformerConfig field pass through; these carry Megatron's
    # names or values. A flag not given (None) leaves the preset's value (or the default).
    renamed = dict(
        vocab_size=vocab_size or args.vocab_size, make_vocab_size_divisible_by=vocab_multiple(args),
        embedding_layernorm=True if args.embed_layernorm else None,
        position_embedding={"learned_absolute": "learned"}.get(args.position_embedding_type,
                                                               args.position_embedding_type),
        rope_theta=args.rotary_base, layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization.lower() if args.normalization else None,
        activation="swiglu" if args.swiglu else "relu2" if args.squared_relu else None,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups
        else None,
        tie_word_embeddings=False if args.untie_embeddings_and_output_weights else None,
        bias=False if args.disable_bias_linear else None,
        # the weights' dtype: the model config holds it (the optimizer is given run.model.dtype)
        params_dtype=next((d for d, flag in DTYPE_FLAGS.items() if getattr(args, flag)), None))
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig)
            if f.name not in renamed and hasattr(args, f.name)}
    overrides = {k: v for k, v in {**same, **renamed}.items() if v is not None}
    given = getattr(args, "given_flags", None)  # None: a namespace not from the parser
    if loaded is not None and (getattr(args, "use_checkpoint_args", False)
                               or (given is not None and "model" not in given)):
        model = _loaded_with_flags(loaded, overrides, args, tokenizer_vocab=bool(vocab_size))
    elif args.model:
        model = _preset_with_flags(args.model, overrides)
    else:
        missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads") if f not in overrides]
        if missing:
            _fail(f"--{missing[0].replace('_', '-')} is required without --model (or give a preset)")
        model = TransformerConfig(**overrides)
    check_model(args, model)
    if model.kv_lora_rank and (args.reset_position_ids or args.reset_attention_mask or args.sft_packing):
        _fail("multi-latent attention (--kv-lora-rank) does not model packed documents; drop "
              "--reset-position-ids/--reset-attention-mask/--sft-packing")
    if model.mtp_num_layers and (args.sft or args.calculate_per_token_loss
                                 or args.context_parallel_size > 1):
        _fail("--mtp-num-layers with --calculate-per-token-loss, --sft or --context-parallel-size "
              "> 1 is not modelled (its loss is a mean per microbatch of targets shifted within "
              "the rank's sequence); drop one")
    seq = args.seq_length or model.max_position_embeddings
    if model.position_embedding == "learned" and seq > model.max_position_embeddings:
        _fail(f"--seq-length {seq} exceeds --max-position-embeddings {model.max_position_embeddings}")
    return model, seq


def layout_config(args, model: TransformerConfig, seq: int, world: int):
    """(the ParallelConfig, dp, the global batch size): the layout flags against the world, the
    model and the batch."""
    try:
        parallel = parallel_config_of(args, model.num_layers,
                                      stage_layers=stage_layers(args, model.num_layers))
        dp = parallel.validate(world)
        model.check_layout(parallel, seq_length=seq)
        check_attention(model.attention_dropout, parallel.cp)
        mbs = args.micro_batch_size
        gas = getattr(args, "gradient_accumulation_steps", None)  # from --deepspeed_config
        if gas is not None and args.global_batch_size not in (None, mbs * gas * dp):
            _fail(f"--global-batch-size {args.global_batch_size} contradicts --deepspeed_config "
                  f"gradient_accumulation_steps {gas} x micro batch {mbs} x dp {dp} = {mbs * gas * dp}")
        gbs = args.global_batch_size or mbs * (gas or 1) * dp
        microbatches_per_step(gbs, mbs, dp, parallel.pp, parallel.vpp)
    except LayoutError as e:
        _fail(str(e))
    return parallel, dp, gbs


def schedule_config(args, parallel, dp: int, gbs: int) -> ScheduleConfig:
    """Iterations, the learning-rate schedule (samples turned into iterations) and the batch ramp."""
    if args.train_iters is None and args.train_samples is None:
        _fail("give --train-iters or --train-samples")
    if args.train_iters is not None and args.train_samples is not None:
        _fail(f"give --train-iters or --train-samples, not both (--train-iters {args.train_iters}, "
              f"--train-samples {args.train_samples}), as Megatron-LM refuses them together")
    train_iters = args.train_iters or args.train_samples // gbs  # Megatron's update_train_iters
    if not train_iters:
        _fail(f"--train-samples {args.train_samples} is less than one global batch ({gbs}): nothing "
              f"to train; give at least {gbs}")
    lr_decay_iters = samples_to_iterations(args, gbs)
    warmup = args.lr_warmup_iters
    if args.lr_warmup_samples:
        warmup = -(-args.lr_warmup_samples // gbs)
    if args.lr_warmup_fraction is not None:  # Megatron: a fraction of the decay iterations
        warmup = int(args.lr_warmup_fraction * (lr_decay_iters or train_iters))
    check_warmup(warmup, lr_decay_iters, train_iters, args.lr)
    mbs = args.micro_batch_size
    if args.rampup_batch_size:
        start, inc, _ = args.rampup_batch_size
        if start % (mbs * dp) or inc % (mbs * dp):
            _fail(f"--rampup-batch-size start {start} and increment {inc} must be multiples of "
                  f"--micro-batch-size x dp = {mbs * dp}")
    return ScheduleConfig(
        micro_batch_size=mbs, global_batch_size=gbs,
        rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        train_iters=train_iters, train_samples=args.train_samples, lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=warmup, lr_decay_iters=lr_decay_iters,
        pipeline_schedule="interleaved" if parallel.vpp > 1 else args.pipeline_schedule,
        exit_interval=args.exit_interval, exit_duration_mins=args.exit_duration_in_mins)


def optimizer_config(args, model: TransformerConfig, parallel, compat) -> OptimizerConfig:
    if args.bf16 and args.fp16:
        _fail("choose one of --bf16 and --fp16")
    optimizer = OptimizerConfig(
        zero_stage=compat.zero_stage, optimizer=args.optimizer, lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        loss_scale=LossScaleConfig(initial_scale=args.initial_loss_scale,
                                   growth_interval=args.loss_scale_window,
                                   hysteresis=args.hysteresis, min_scale=args.min_loss_scale,
                                   static_scale=args.loss_scale),
        grad_dtype="model" if args.grad_reduce_in_bf16 else "fp32",
        bucket_numel=args.ddp_bucket_size or OptimizerConfig.bucket_numel,
        offload=args.offload_optimizer, offload_dir=args.offload_dir,
        muon=muon_settings(args, _fail),
        qk_clip=qk_clip_settings(args, model, parallel.cp, _fail))
    try:
        optimizer.validate(pp=parallel.pp)
    except ValueError as e:
        _fail(str(e))
    return optimizer


def health_config(args) -> HealthConfig:
    health = HealthConfig(
        policy=args.health_policy, spike_zscore=args.spike_zscore, spike_window=args.spike_window,
        collective_timeout=args.collective_timeout, straggler_threshold=args.straggler_threshold,
        max_bad_steps=args.max_bad_steps,
        inject_nan_at=args.inject_nan_at_iteration,
        inject_hang=(int(args.inject_hang[0]), int(args.inject_hang[1]), args.inject_hang[2])
        if args.inject_hang else None)
    try:
        health.validate()
    except ValueError as e:
        _fail(str(e))
    if args.health_policy == "rollback" and not (args.save and args.save_interval):
        _fail("--health-policy rollback needs --save and --save-interval (checkpoints to roll back to)")
    return health


def data_config(args, seq: int, compat, eod_token: int | None, pad_mask_token: int | None = None) -> DataConfig:
    if not args.data_path and not args.mock_data and not args.grpo_prompts and not per_split_given(args):
        _fail("give --data-path PREFIX (from tools/preprocess_data.py), --train-data-path PREFIX or --mock-data")
    if args.sft and (args.mock_data or len(args.data_path) != 1):
        _fail("--sft needs one --data-path PREFIX (the --output-prefix of tools/preprocess_sft.py)")
    if args.sft_packing and not args.sft:
        _fail("--sft-packing packs conversations: add --sft")
    if (args.reset_position_ids or args.reset_attention_mask) and eod_token is None:
        _fail("--reset-position-ids/--reset-attention-mask need a tokenizer to name the end-of-document "
              "id (--vocab-file/--merge-file, --tokenizer-model, or --tokenizer-type NullTokenizer)")
    if args.sft and (args.reset_position_ids or args.reset_attention_mask):
        _fail("--sft samples hold one conversation each, or use --sft-packing (documents reset "
              "by conversation); drop --reset-position-ids/--reset-attention-mask")
    for path in args.data_path:
        if path.endswith((".bin", ".idx")):
            _fail(f"--data-path {path}: give the prefix without the suffix, --data-path {path[:-4]}")
    return from_flags(DataConfig, args, seq_length=seq, eod_mask_token=compat.eod_mask_token,
                      pad_token=eod_token or 0, eod_token=eod_token,
                      pad_mask_token=None if args.sft or args.dpo else pad_mask_token,
                      per_token_loss=args.sft or args.calculate_per_token_loss)


__all__ = ["ArgumentError", "LayoutError", "to_run_config"]
