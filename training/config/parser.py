"""The command line: every flag with its default and help (Megatron-LM names), and the parser
that maps the Megatron-LM / DeepSpeed spellings and lists every refusal of a command line at once.
What the values mean and how they fit together: training/config/flags.py."""
from __future__ import annotations

import argparse
import sys

from megazoo.models.presets import PRESETS

from megazoo.training.config.errors import ArgumentError
from megazoo.training.config.flag_help import HelpFormatter, apply_help
from megazoo.training.config.megatron_compat import add_megatron_compat_flags, translate
from megazoo.training.config.dpo_flags import add_dpo_flags
from megazoo.training.config.lora_flags import add_lora_flags
from megazoo.training.config.muon_flags import add_muon_flags
from megazoo.training.config.run_config import HealthConfig


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


def build_parser(default_model: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(description="megazoo pretraining (Megatron-LM flag names; docs/megatron.md maps them)",
                allow_abbrev=False, formatter_class=HelpFormatter)
    a = p.add_argument
    g = p.add_argument_group("model")
    g.add_argument("--model", default=default_model, help=f"preset: {', '.join(sorted(PRESETS))}")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                 "--max-position-embeddings", "--make-vocab-size-divisible-by"):
        g.add_argument(flag, type=int)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--init-method-std", type=float)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "alibi"])
    g.add_argument("--rotary-base", type=float, help="RoPE theta")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--add-qkv-bias", action="store_true", default=None)
    g.add_argument("--qk-layernorm", action="store_true", default=None)
    g = p.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--num-experts", type=int, help="experts per MoE layer (none: dense MLPs)")
    g.add_argument("--moe-router-topk", type=int, help="experts per token")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts, then top-k (Qwen); default top-k, then softmax (Mixtral)")
    g.add_argument("--moe-aux-loss-coeff", type=float, help="Switch/GShard load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, help="router z-loss (ST-MoE)")
    g.add_argument("--moe-expert-capacity-factor", type=float,
                   help="drop assignments over factor x tokens x topk / experts per expert (default dropless)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, help="a shared expert's width")
    g.add_argument("--moe-first-dense-layers", type=int,
                   help="the first K layers dense (DeepSeek-V3's first_k_dense_replace)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"),
                   help="softmax (default) or sigmoid scores (DeepSeek-V3: the chosen scores weigh)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="sigmoid: a per-expert bias for the choice only, updated from the load after "
                        "each step (aux-loss-free balancing)")
    g.add_argument("--moe-router-bias-update-rate", type=float,
                   help="the expert bias's step towards the mean load (default 1e-3)")
    g.add_argument("--moe-router-num-groups", type=int,
                   help="sigmoid: expert groups for group-limited routing (HF n_group)")
    g.add_argument("--moe-router-group-topk", type=int,
                   help="groups each token may route to (HF topk_group)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float,
                   help="routing weights times this (HF routed_scaling_factor)")
    g.add_argument("--mtp-num-layers", type=int,
                   help="multi-token prediction depths (DeepSeek-V3; HF num_nextn_predict_layers)")
    g.add_argument("--mtp-loss-scaling-factor", type=float,
                   help="weight of the depths' mean loss added to the main loss (default 0.1)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks (carved out of data parallelism) splitting each layer's experts")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="layers on the first pipeline stage (uneven split; it also holds the "
                        "embedding); the other stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int,
                   help="layers on the last pipeline stage (it also holds the head and loss)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split every sample's sequence over this many ranks (carved from data "
                        "parallelism); each holds chunks i and 2C-1-i (load-balanced causal)")
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "a2a"],
                   help="context-parallel attention: p2p = ring attention (K/V blocks around the "
                        "ring), a2a = all-to-all over heads (DeepSpeed-Ulysses)")
    g.add_argument("--pipeline-schedule", default="1f1b", choices=["1f1b", "gpipe", "no_pipelining"])
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int)
    g.add_argument("--lr-decay-iters", type=int)
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "muon"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--zero-stage", type=int)
    g.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    g.add_argument("--offload-dir")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="full: whole layers (see --recompute-method); selective: the attention core")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="full only: units of N layers (uniform, default) or the first N layers "
                        "of each pipeline chunk (block)")
    g.add_argument("--recompute-num-layers", type=int, help="full only: N (default 1)")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[])
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of --data-path")
    for flag, text in (
            ("--sft", "chat fine-tuning: --data-path is a prefix from tools/preprocess_sft.py; loss on "
                      "assistant tokens only, averaged over the global batch (docs/sft.md)"),
            ("--sft-packing", "--sft: pack conversations into each sample (document masks, positions "
                              "restarting) instead of one padded conversation per sample"),
            ("--reset-position-ids", "positions restart after every end-of-document token"),
            ("--reset-attention-mask", "no token attends across an end-of-document token"),
            ("--calculate-per-token-loss", "loss = sum over the global batch's counted tokens / their "
                                           "number (not a mean of microbatch means); implied by --sft")):
        g.add_argument(flag, action="store_true", help=text)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int, help="model vocabulary when no tokenizer is given")
    g.add_argument("--data-cache-path")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="the model is --load's (its checkpoint's config) even with --model; "
                        "without --model that is the default")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--peak-flops", type=float, help="per-device peak FLOP/s for MFU")
    g.add_argument("--tensorboard-dir")
    g = p.add_argument_group("health")
    g.add_argument("--health-policy", default="warn", choices=["warn", "skip", "rollback"],
                   help="on a loss spike or NaN: log it, drop the step's update, or reload the last "
                        "checkpoint and skip the offending samples")
    g.add_argument("--spike-zscore", type=float, default=6.0)
    g.add_argument("--spike-window", type=int, default=50)
    g.add_argument("--collective-timeout", type=float, default=HealthConfig.collective_timeout,
                   help="seconds (default 5 minutes; 0: off) before a hung collective ends the job "
                        "naming the ranks that did not arrive or froze")
    g.add_argument("--straggler-threshold", type=float, default=1.25)
    g.add_argument("--inject-nan-at-iteration", type=int, help="fault drill: NaN gradients once")
    g.add_argument("--inject-hang", nargs=3, type=float, metavar=("RANK", "ITERATION", "SECONDS"),
                   help="fault drill: RANK sleeps SECONDS before a collective at ITERATION")
    g = p.add_argument_group("checkpoint storage / health")
    g.add_argument("--keep-last", type=int, help="keep only the newest N checkpoints (default: all)")
    g.add_argument("--keep-every", type=int,
                   help="with --keep-last: also keep every checkpoint whose iteration is a multiple of K")
    g.add_argument("--max-bad-steps", type=int, default=20,
                   help="stop the run (exit status 1) after this many consecutive steps with a "
                        "non-finite loss or a skipped update, under any --health-policy")
    add_muon_flags(p)
    add_lora_flags(p)
    add_dpo_flags(p)
    add_megatron_compat_flags(p)
    a("--seed", type=int, default=1234)
    apply_help(p)
    return p
