"""The command line: every flag with its default and help (Megatron-LM names), and the parser
that maps the Megatron-LM / DeepSpeed spellings and lists every refusal of a command line at once.
What the values mean and how they fit together: training/config/flags.py."""
from __future__ import annotations

import argparse
import sys

from megazoo.models.presets import PRESETS

from megazoo.training.config.data_sources import add_data_source_flags
from megazoo.training.config.errors import ArgumentError
from megazoo.training.config.flag_help import HelpFormatter, apply_help
from megazoo.training.config.layout_flags import BY_FIELD, add_layout_flags
from megazoo.training.config.megatron_compat import add_megatron_compat_flags, translate
from megazoo.training.config.dpo_flags import add_dpo_flags
from megazoo.training.config.grpo_flags import add_grpo_flags
from megazoo.training.config.lora_flags import add_lora_flags
from megazoo.training.config.muon_flags import add_muon_flags
from megazoo.training.config.run_config import COMPILE_BACKENDS, HealthConfig
from megazoo.training.config.validation_flags import add_validation_flags


class _Parser(argparse.ArgumentParser):
    """Flag errors raise ArgumentError (printed once by the script, no usage dump per rank)."""

    def error(self, message):
        raise ArgumentError(f"{message} (--help lists the flags)")

    def parse_known_args(self, args=None, namespace=None):
        """Parse, then map the Megatron-LM / DeepSpeed flags (training/config/megatron_compat.py):
        every refusal and every unknown flag of the command line in one error, before any work."""
        argv = list(sys.argv[1:] if args is None else args)
        ns, unknown = super().parse_known_args(argv, namespace)
        flags = {opt: a.dest for a in self._actions for opt in a.option_strings}
        given = {flags[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in flags}
        problems, notes = translate(ns, given, lambda dest: next(o for o, d in flags.items() if d == dest))
        if unknown:
            problems.append(f"unrecognized arguments: {' '.join(unknown)} (not megazoo flags, nor "
                            f"Megatron-LM/DeepSpeed flags megazoo knows; --help lists the flags)")
        if len(problems) == 1:
            raise ArgumentError(problems[0])
        if problems:
            raise ArgumentError(f"{len(problems)} refusals, nothing started:\n  "
                                + "\n  ".join(problems))
        notes.emit()
        ns.given_flags = frozenset(given)  # what the command line set (not a default)
        return ns, []


# The core flags, group by group: (flag, argparse keywords). Help not given here comes from
# flag_help.py; the layout flags come from layout_flags.py, Muon's from muon_flags.py, the other
# Megatron-LM / DeepSpeed spellings from megatron_compat.py.
_INT, _FLOAT, _SWITCH, _ON = dict(type=int), dict(type=float), dict(action="store_true"), \
    dict(action="store_true", default=None)  # _ON: None when not given (the preset decides)
MODEL_FLAGS = (
    *((flag, _INT) for flag in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                "--ffn-hidden-size", "--max-position-embeddings",
                                "--make-vocab-size-divisible-by", "--seq-length",
                                "--num-query-groups", "--kv-channels")),
    *((flag, _FLOAT) for flag in ("--hidden-dropout", "--attention-dropout", "--init-method-std",
                                  "--norm-epsilon")),
    ("--position-embedding-type", dict(choices=["learned_absolute", "rope", "alibi"])),
    ("--rotary-base", dict(type=float, help="RoPE theta")),
    ("--normalization", dict(choices=["LayerNorm", "RMSNorm"])),
    ("--group-query-attention", _SWITCH),
    *((flag, _ON) for flag in ("--swiglu", "--untie-embeddings-and-output-weights",
                               "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm")),
)
MOE_FLAGS = (
    ("--num-experts", dict(type=int, help="experts per MoE layer (none: dense MLPs)")),
    ("--moe-router-topk", dict(type=int, help="experts per token")),
    ("--moe-ffn-hidden-size", dict(type=int, help="each expert's width (default --ffn-hidden-size)")),
    ("--moe-router-pre-softmax", dict(_ON, help="softmax over all experts, then top-k (Qwen); "
                                                "default top-k, then softmax (Mixtral)")),
    ("--moe-aux-loss-coeff", dict(type=float, help="Switch/GShard load-balancing loss")),
    ("--moe-z-loss-coeff", dict(type=float, help="router z-loss (ST-MoE)")),
    ("--moe-expert-capacity-factor", dict(type=float, help="drop assignments over factor x tokens "
                                                           "x topk / experts per expert (default dropless)")),
    ("--moe-shared-expert-intermediate-size", dict(type=int, help="a shared expert's width")),
    ("--moe-first-dense-layers", dict(type=int, help="the first K layers dense (DeepSeek-V3's "
                                                     "first_k_dense_replace)")),
    ("--moe-router-score-function", dict(choices=("softmax", "sigmoid"), help=(
        "softmax (default) or sigmoid scores (DeepSeek-V3: the chosen scores weigh)"))),
    ("--moe-router-enable-expert-bias", dict(_ON, help=(
        "sigmoid: a per-expert bias for the choice only, updated from the load after each step "
        "(aux-loss-free balancing)"))),
    ("--moe-router-bias-update-rate", dict(type=float, help="the expert bias's step towards the "
                                                            "mean load (default 1e-3)")),
    ("--moe-router-num-groups", dict(type=int, help="sigmoid: expert groups for group-limited "
                                                    "routing (HF n_group)")),
    ("--moe-router-group-topk", dict(type=int, help="groups each token may route to (HF topk_group)")),
    ("--moe-router-topk-scaling-factor", dict(type=float, help="routing weights times this (HF "
                                                               "routed_scaling_factor)")),
    ("--mtp-num-layers", dict(type=int, help="multi-token prediction depths (DeepSeek-V3; HF "
                                             "num_nextn_predict_layers)")),
    ("--mtp-loss-scaling-factor", dict(type=float, help="weight of the depths' mean loss added to "
                                                        "the main loss (default 0.1)")),
)
SCHEDULE_FLAGS = (
    ("--pipeline-schedule", dict(default="1f1b", choices=["1f1b", "gpipe", "no_pipelining"])),
    ("--micro-batch-size", dict(type=int, default=1)),
    ("--global-batch-size", _INT),
    ("--rampup-batch-size", dict(nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"))),
    ("--train-iters", _INT), ("--train-samples", _INT),
    ("--lr", dict(type=float, default=1e-3)), ("--min-lr", dict(type=float, default=0.0)),
    ("--lr-decay-style", dict(default="cosine", choices=["constant", "linear", "cosine"])),
    ("--lr-warmup-iters", dict(type=int, default=0)), ("--lr-warmup-samples", _INT),
    ("--lr-decay-iters", _INT),
)
OPTIMIZER_FLAGS = (
    ("--optimizer", dict(default="adamw", choices=["adamw", "adam", "sgd", "muon"])),
    ("--weight-decay", dict(type=float, default=0.01)), ("--clip-grad", dict(type=float, default=1.0)),
    ("--adam-beta1", dict(type=float, default=0.9)), ("--adam-beta2", dict(type=float, default=0.999)),
    ("--adam-eps", dict(type=float, default=1e-8)), ("--bf16", _SWITCH), ("--fp16", _SWITCH),
    ("--initial-loss-scale", dict(type=float, default=2.0 ** 16)),
    ("--loss-scale-window", dict(type=int, default=1000)), ("--hysteresis", dict(type=int, default=2)),
    ("--min-loss-scale", dict(type=float, default=1.0)),
    ("--offload-optimizer", dict(default="none", choices=["none", "cpu", "nvme"])),
    ("--offload-dir", {}),
    ("--recompute-granularity", dict(choices=["full", "selective"], help=(
        "full: whole layers (see --recompute-method); selective: the attention core"))),
    ("--recompute-method", dict(choices=["uniform", "block"], help=(
        "full only: units of N layers (uniform, default) or the first N layers of each pipeline "
        "chunk (block)"))),
    ("--recompute-num-layers", dict(type=int, help="full only: N (default 1)")),
)
DATA_FLAGS = (
    ("--data-path", dict(nargs="*", default=[])),
    ("--mock-data", dict(_SWITCH, help="synthetic tokens instead of --data-path")),
    ("--sft", dict(_SWITCH, help="chat fine-tuning: --data-path is a prefix from "
                                 "tools/preprocess_sft.py; loss on assistant tokens only, averaged "
                                 "over the global batch (docs/sft.md)")),
    ("--sft-packing", dict(_SWITCH, help="--sft: pack conversations into each sample (document "
                                         "masks, positions restarting) instead of one padded "
                                         "conversation per sample")),
    ("--reset-position-ids", dict(_SWITCH, help="positions restart after every end-of-document token")),
    ("--reset-attention-mask", dict(_SWITCH, help="no token attends across an end-of-document token")),
    ("--calculate-per-token-loss", dict(_SWITCH, help=(
        "loss = sum over the global batch's counted tokens / their number (not a mean of "
        "microbatch means); implied by --sft"))),
    ("--split", dict(default="969,30,1")), ("--tokenizer-type", dict(default="GPT2BPETokenizer")),
    ("--vocab-file", {}), ("--merge-file", {}), ("--tokenizer-model", {}),
    ("--vocab-size", dict(type=int, help="model vocabulary when no tokenizer is given")),
    ("--data-cache-path", {}),
)
CHECKPOINT_FLAGS = (
    ("--save", {}), ("--load", {}), ("--save-interval", _INT), ("--async-save", _SWITCH),
    ("--finetune", _SWITCH),
    ("--use-checkpoint-args", dict(_SWITCH, help="the model is --load's (its checkpoint's config) "
                                                 "even with --model; without --model that is the "
                                                 "default")),
    ("--keep-last", dict(type=int, help="keep only the newest N checkpoints (default: all)")),
    ("--keep-every", dict(type=int, help="with --keep-last: also keep every checkpoint whose "
                                         "iteration is a multiple of K")),
)
LOGGING_FLAGS = (
    ("--log-interval", dict(type=int, default=10)), ("--eval-interval", dict(type=int, default=100)),
    ("--eval-iters", dict(type=int, default=10)),
    ("--eval-tasks", dict(nargs="+", default=[])), ("--eval-tasks-interval", dict(type=int, default=0)),
    ("--eval-tasks-limit", _INT), ("--eval-tasks-batch-size", dict(type=int, default=8)),
    ("--wandb-project", {}), ("--wandb-exp-name", {}),
    ("--wandb-save-dir", {}), ("--peak-flops", dict(type=float, help="per-device peak FLOP/s for MFU")),
    ("--tensorboard-dir", {}),
)
HEALTH_FLAGS = (
    ("--health-policy", dict(default="warn", choices=["warn", "skip", "rollback"], help=(
        "on a loss spike or NaN: log it, drop the step's update, or reload the last checkpoint "
        "and skip the offending samples"))),
    ("--spike-zscore", dict(type=float, default=6.0)), ("--spike-window", dict(type=int, default=50)),
    ("--collective-timeout", dict(type=float, default=HealthConfig.collective_timeout, help=(
        "seconds (default 5 minutes; 0: off) before a hung collective ends the job naming the "
        "ranks that did not arrive or froze"))),
    ("--straggler-threshold", dict(type=float, default=1.25)),
    ("--inject-nan-at-iteration", dict(type=int, help="fault drill: NaN gradients once")),
    ("--inject-hang", dict(nargs=3, type=float, metavar=("RANK", "ITERATION", "SECONDS"),
                           help="fault drill: RANK sleeps SECONDS before a collective at ITERATION")),
    ("--max-bad-steps", dict(type=int, default=20, help=(
        "stop the run (exit status 1) after this many consecutive steps with a non-finite loss "
        "or a skipped update, under any --health-policy"))),
    ("--seed", dict(type=int, default=1234)),
)
COMPILE_FLAGS = (
    ("--compile", dict(_SWITCH, help="compile each transformer layer with torch.compile (the rest "
                                     "eager; training/run/compile.py)")),
    ("--compile-backend", dict(choices=COMPILE_BACKENDS, help="with --compile: inductor (default; the "
                                                      "CPU's C++ or CUDA's Triton kernels), or "
                                                      "aot_eager / eager to check tracing only")),
)
GROUPS = (("model", MODEL_FLAGS), ("mixture of experts (docs/moe.md)", MOE_FLAGS),
          ("batch and schedule", SCHEDULE_FLAGS), ("optimizer", OPTIMIZER_FLAGS),
          ("data", DATA_FLAGS), ("checkpoints", CHECKPOINT_FLAGS), ("logging", LOGGING_FLAGS),
          ("health", HEALTH_FLAGS), ("compilation", COMPILE_FLAGS))


def build_parser(default_model: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(description="megazoo pretraining (Megatron-LM flag names; docs/megatron.md maps them)",
                allow_abbrev=False, formatter_class=HelpFormatter)
    p.add_argument("--model", default=default_model, help=f"preset: {', '.join(sorted(PRESETS))}")
    # the data-parallel size comes from the world; --zero-stage None: 0, or what
    # --use-distributed-optimizer / --deepspeed_config say (megatron_compat.py)
    add_layout_flags(p, fields=set(BY_FIELD) - {"dp"}, defaults={"zero_stage": None},
                     title="parallelism (training/config/layout_flags.py)")
    for title, flags in GROUPS:
        group = p.add_argument_group(title)
        for flag, keywords in flags:
            group.add_argument(flag, **keywords)
        if flags is DATA_FLAGS:
            add_data_source_flags(group)
        if flags is LOGGING_FLAGS:
            add_validation_flags(group)
    add_muon_flags(p)
    add_lora_flags(p)
    add_dpo_flags(p)
    add_grpo_flags(p)
    add_megatron_compat_flags(p)
    apply_help(p)
    return p
