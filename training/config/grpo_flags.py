"""The GRPO flags (TRL's GRPOConfig names: num_generations, max_completion_length, temperature,
top_p, beta, epsilon, epsilon_high, loss_type, scale_rewards) and the GRPOSettings they make
(training/run/grpo_online.py runs the loop inside the trainer)."""
from __future__ import annotations

import argparse

from megazoo.training.config.run_config import GRPOSettings

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
DEFAULTS = dict(num_generations=8, max_completion_length=256, temperature=1.0, top_p=1.0, beta=0.0,
                epsilon=0.2, epsilon_high=None, loss_type="dapo", scale_rewards="group",
                grpo_chat=False, grpo_reference=None, reward=None, num_iterations=1,
                mask_truncated_completions=False, reward_weights=None)


def add_grpo_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GRPO (docs/post_training.md)")
    g.add_argument("--grpo-prompts", metavar="FILE.jsonl",
                   help="online GRPO: `prompt` (a string) or `messages` per line, its other fields "
                        "passed to --reward; no --data-path")
    g.add_argument("--reward", metavar="MODULE:FUNCTION",
                   help="fn(prompts=, completions=, **fields) -> one float (or None) per "
                        "completion; several, comma-separated, are summed with --reward-weights")
    g.add_argument("--reward-weights", type=float, nargs="+", metavar="W",
                   help="one weight per --reward function (TRL's reward_weights; default all 1)")
    g.add_argument("--num-iterations", type=int, default=DEFAULTS["num_iterations"],
                   help="optimizer steps on each generation batch (TRL's num_iterations): the "
                        "ratio is taken against the sampling policy's log-probabilities")
    g.add_argument("--mask-truncated-completions", action="store_true",
                   help="no loss on completions that reach --max-completion-length without an eos")
    g.add_argument("--grpo-chat", action="store_true",
                   help="put `prompt` strings through the tokenizer's chat template")
    g.add_argument("--num-generations", type=int, default=DEFAULTS["num_generations"],
                   help="completions sampled per prompt (a group); --micro-batch-size must equal it "
                        "and --global-batch-size counts completions")
    g.add_argument("--max-completion-length", type=int, default=DEFAULTS["max_completion_length"],
                   help="tokens sampled per completion at most")
    g.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                   help="sampling temperature")
    g.add_argument("--top-p", type=float, default=DEFAULTS["top_p"],
                   help="nucleus sampling: keep the smallest set of tokens of this probability")
    g.add_argument("--beta", type=float, default=DEFAULTS["beta"],
                   help="KL strength (0: no reference model)")
    g.add_argument("--epsilon", type=float, default=DEFAULTS["epsilon"], help="clip range below 1")
    g.add_argument("--epsilon-high", type=float, help="clip range above 1 (default: --epsilon)")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default=DEFAULTS["loss_type"],
                   help="how the per-token loss is normalised, as TRL names it")
    g.add_argument("--scale-rewards", choices=SCALES, default=DEFAULTS["scale_rewards"],
                   help="divide advantages by the reward spread of the group, the batch, or not")
    g.add_argument("--grpo-reference", metavar="DIR",
                   help="--beta > 0 without LoRA: the KL reference's checkpoint (default: --load "
                        "with --finetune; needed to resume)")


def grpo_settings(args: argparse.Namespace, parallel, lora, zero_stage: int) -> GRPOSettings | None:
    """The run's GRPOSettings, or None without --grpo-prompts; raises ValueError naming the flag."""
    if not args.grpo_prompts:
        changed = [k for k, v in DEFAULTS.items() if getattr(args, k) != v]
        if changed:
            raise ValueError(f"--{changed[0].replace('_', '-')} is a GRPO flag: it needs --grpo-prompts")
        return None
    if not args.reward:
        raise ValueError("--grpo-prompts needs --reward MODULE:FUNCTION (the reward of a completion)")
    if args.dpo or args.sft or args.sft_packing:
        raise ValueError("--grpo-prompts excludes --dpo and --sft: one objective per run")
    if args.data_path or args.mock_data:
        raise ValueError("--grpo-prompts samples its own completions: drop --data-path/--mock-data")
    if parallel.pp > 1 or parallel.cp > 1 or parallel.sequence_parallel:
        raise ValueError("--grpo-prompts generates with the whole model on every tensor-parallel "
                         "group: --pipeline-model-parallel-size 1, --context-parallel-size 1, no "
                         "--sequence-parallel")
    if zero_stage >= 3:
        raise ValueError("--grpo-prompts samples with the training weights, which ZeRO-3 shards: "
                         "use --zero-stage 1 or 2")
    if args.micro_batch_size != args.num_generations:
        raise ValueError(f"--grpo-prompts: --micro-batch-size {args.micro_batch_size} must equal "
                         f"--num-generations {args.num_generations} (a microbatch is one prompt's group)")
    if args.rampup_batch_size:
        raise ValueError("--grpo-prompts takes a fixed number of prompts per step: drop "
                         "--rampup-batch-size")
    given = getattr(args, "given_flags", None) or ()
    held_out = [f for f in ("eval_interval", "split") if f in given]
    if held_out or ("eval_iters" in given and args.eval_iters):
        flag = (held_out or ["eval_iters"])[0].replace("_", "-")
        raise ValueError(f"--grpo-prompts has no held-out evaluation: drop --{flag} (--eval-tasks "
                         f"runs lm-eval tasks)")
    if args.health_policy == "rollback":
        raise ValueError("--grpo-prompts: --health-policy rollback replays a dataset's samples; use "
                         "warn or skip")
    if args.num_iterations < 1:
        raise ValueError(f"--num-iterations must be >= 1, got {args.num_iterations}")
    n_rewards = len([r for r in args.reward.split(",") if r.strip()])
    if args.reward_weights is not None and len(args.reward_weights) != n_rewards:
        raise ValueError(f"--reward-weights gives {len(args.reward_weights)} weights for {n_rewards} "
                         f"--reward functions: give one per function")
    if args.beta < 0:
        raise ValueError(f"--beta must be >= 0, got {args.beta}")
    reference = args.grpo_reference
    if lora is not None and reference:
        raise ValueError("--grpo-reference with LoRA: the reference is the base with the adapters "
                         "off; drop --grpo-reference")
    if args.beta > 0 and lora is None and not reference:
        if not (args.load and args.finetune):
            raise ValueError("--beta > 0 without LoRA needs the KL reference: --load CKPT --finetune "
                             "(the start is the reference) or --grpo-reference CKPT")
        reference = args.load
    if args.beta == 0 and reference:
        raise ValueError("--grpo-reference is the KL reference: give --beta > 0 or drop it")
    return GRPOSettings(num_generations=args.num_generations,
                        max_completion_length=args.max_completion_length,
                        temperature=args.temperature, top_p=args.top_p, beta=args.beta,
                        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high or args.epsilon,
                        loss_type=args.loss_type, scale_rewards=args.scale_rewards,
                        prompts=args.grpo_prompts, reward=args.reward, chat=args.grpo_chat,
                        reference=reference if lora is None else None,
                        num_iterations=args.num_iterations,
                        mask_truncated_completions=args.mask_truncated_completions,
                        reward_weights=tuple(args.reward_weights) if args.reward_weights else None)
