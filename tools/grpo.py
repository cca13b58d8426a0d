"""GRPO online training of a megazoo checkpoint: groups of completions sampled with the training
weights, scored by a reward function, the clipped policy-gradient loss (docs/post_training.md).

    python tools/grpo.py --load ckpt/llama --prompts prompts.jsonl \
        --reward examples.grpo.rewards:sum_digit --save runs/grpo --train-iters 50
    torchrun --nproc_per_node 2 tools/grpo.py ...      # tensor parallel: tp = the world size

--prompts: one JSON object a line with `prompt` (text, put through the checkpoint tokenizer's
chat template with --chat, else encoded as is) or `messages` (a chat, always templated, ready
for the assistant's turn); its other fields are passed to the reward function by name, as lists
aligned with `completions`. The reward function is called as fn(prompts=..., completions=...,
**fields) and returns one float per completion. Each step takes --prompts-per-step prompts in
order (cycling), samples --grpo-num-generations completions of each, takes one AdamW step and
appends the metrics (reward mean and std, KL, clip fraction, completion lengths, generation and
training seconds) to --save/metrics.jsonl. --grpo-beta > 0 adds the KL to a frozen copy of the
starting weights. --tp sets tensor parallelism (default: the world size); the other ranks are
data parallel, each sampling its share of the step's prompts (every prompt with its own seeded
generator, so the samples do not depend on the layout) and the gradients are summed over them.
Pipeline and context parallelism are not supported: the whole model runs on every tp group.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from megazoo.data.tokenizers import TokenizerError
from megazoo.parallel.topology import LayoutError, ParallelConfig, initialize
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.hf import load_model_chunks
from megazoo.training.checkpoint.tokenizer import checkpoint_tokenizer, eos_token_ids
from megazoo.training.monitor.journal import RunJournal
from megazoo.training.run.dpo import Reference
from megazoo.training.run.grpo import LOSS_TYPES
from megazoo.training.run.grpo_online import GRPOSettings, grpo_step, load_reward

logger = logging.getLogger("megazoo.grpo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root (with 'latest') or iter_* folder")
    p.add_argument("--prompts", required=True, help="jsonl: `prompt` or `messages` per line")
    p.add_argument("--reward", required=True, help="module:function returning a float per completion")
    p.add_argument("--save", required=True, help="folder for metrics.jsonl")
    p.add_argument("--chat", action="store_true", help="put `prompt` strings through the chat template")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the world size; the rest "
                                         "is data parallelism)")
    p.add_argument("--grpo-num-generations", type=int, default=4)
    p.add_argument("--grpo-max-completion-length", type=int, default=16)
    p.add_argument("--grpo-temperature", type=float, default=1.0)
    p.add_argument("--grpo-top-p", type=float, default=1.0)
    p.add_argument("--grpo-beta", type=float, default=0.0, help="KL strength (0: no reference)")
    p.add_argument("--grpo-epsilon", type=float, default=0.2, help="clip range below 1")
    p.add_argument("--grpo-epsilon-high", type=float, help="clip range above 1 (default: --grpo-epsilon)")
    p.add_argument("--grpo-loss-type", choices=LOSS_TYPES, default="dapo")
    p.add_argument("--grpo-scale-rewards", choices=("group", "batch", "none"), default="group")
    return p


def render(tok, record: dict, chat: bool, where: str) -> list[int]:
    if "messages" in record or chat:
        template = getattr(tok, "chat_template", None)
        if not template:
            raise TokenizerError(f"{where}: the checkpoint's tokenizer has no chat template; give "
                                 f"plain `prompt` strings without --chat")
        from transformers.utils.chat_template_utils import render_jinja_template
        chat_ = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        rendered, _ = render_jinja_template([chat_], chat_template=template, add_generation_prompt=True,
                                            **tok.special_tokens())
        return tok.encode(rendered[0])
    return tok.encode(record["prompt"])


def read_prompts(path: str, tok, chat: bool) -> tuple[list[dict], list[list[int]]]:
    records, encoded = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
                raise ValueError(f"--prompts {path} line {n}: need a `prompt` string or `messages`")
            ids = render(tok, rec, chat, f"--prompts {path} line {n}")
            if not ids:
                raise ValueError(f"--prompts {path} line {n}: the prompt encodes to no tokens")
            records.append(rec)
            encoded.append(ids)
    if not records:
        raise ValueError(f"--prompts {path}: no prompts")
    return records, encoded


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    owned = not dist.is_initialized()
    try:
        return _run(args)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _run(args) -> int:
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        settings = GRPOSettings(
            num_generations=args.grpo_num_generations, max_completion_length=args.grpo_max_completion_length,
            temperature=args.grpo_temperature, top_p=args.grpo_top_p, beta=args.grpo_beta,
            epsilon_low=args.grpo_epsilon, epsilon_high=args.grpo_epsilon_high or args.grpo_epsilon,
            loss_type=args.grpo_loss_type, scale_rewards=args.grpo_scale_rewards)
        if args.prompts_per_step < 1 or args.train_iters < 1:
            raise ValueError("--prompts-per-step and --train-iters must be >= 1")
        reward_fn = load_reward(args.reward)
        folder = ckpt.resolve(args.load)
        tok = checkpoint_tokenizer(folder)
        records, prompts = read_prompts(args.prompts, tok, args.chat)
        eos = tuple(eos_token_ids(folder, ckpt.read_meta(folder)) or [tok.eod])
        world = int(os.environ.get("WORLD_SIZE", "1"))
        tp = args.tp or world
        if world % tp or args.prompts_per_step % (world // tp):
            raise ValueError(f"--tp {tp} must divide the world size {world}, and the data-parallel "
                             f"size {world // max(tp, 1)} must divide --prompts-per-step {args.prompts_per_step}")
        topo = initialize(ParallelConfig(tp=tp))
        _, (model,) = load_model_chunks(folder, topo)
        frozen = load_model_chunks(folder, topo)[1][0].requires_grad_(False) if settings.beta else None
    except (ckpt.CheckpointError, TokenizerError, LayoutError, ValueError, OSError) as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    model.train()
    reference = Reference([model], [frozen]) if frozen is not None else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.0)
    journal = RunJournal(args.save if topo.rank == 0 else None)
    n, share = args.prompts_per_step, args.prompts_per_step // topo.dp
    for it in range(1, args.train_iters + 1):
        # this data-parallel rank's prompts; each sampled with its own generator (layout-free)
        slots = [(it - 1) * n + topo.dp_rank * share + j for j in range(share)]
        idx = [k % len(records) for k in slots]
        generators = [torch.Generator(device=topo.device).manual_seed(args.seed * 1_000_003 + k) for k in slots]
        metrics = grpo_step(model, topo, [records[i] for i in idx], [prompts[i] for i in idx], reward_fn,
                            tok.decode, settings, eos, reference, generators)
        metrics.pop("_batch")
        opt.step()
        opt.zero_grad()
        journal.metrics(it, "grpo", metrics)
        if topo.rank == 0:
            logger.info("iteration %d: %s", it, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
