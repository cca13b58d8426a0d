"""GRPO's objective (Shao et al. 2024) on a batch of sampled completions, as TRL's GRPOTrainer
computes it: group-normalised advantages and the clipped policy-gradient loss with an optional
KL penalty to a reference, normalised per token by one of TRL's loss types.

    advantage  (r - mean of the prompt's group) / (std of the group (Bessel) + 1e-4)
    ratio      exp(logp - logp_old) per completion token
    per token  -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)
               + beta (exp(ref - logp) - (ref - logp) - 1) [x ratio: TRL's default
                 bias correction, the unbiased reverse-KL gradient]
    grpo       mean over sequences of (sum over the sequence's tokens / its token count)
    bnpo       sum over tokens / token count
    dr_grpo    sum over tokens / (sequences x max completion length)
    dapo       sum over tokens / the tokens of the whole generation batch (`num_items`)

The per-token log-probabilities are minus the per-token losses of megazoo's model
(`completion_logps`), so the objective runs under any tensor-parallel layout. The online loop
(sampling groups with the training weights, a reward function) is training/run/grpo_online.py,
run by the trainer with --grpo-prompts (training/run/grpo_train.py).
"""
from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> torch.Tensor:
    """Advantages of rewards [n] (n = prompts x group, a prompt's completions adjacent);
    scale: "group" (its group's std), "batch" (the batch's std) or "none"."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    if scale == "none":
        return rewards - mean
    std = grouped.std(1).repeat_interleave(group) if scale == "group" else rewards.std().expand_as(rewards)
    return (rewards - mean) / (std + 1e-4)


def completion_logps(chunk, tokens: torch.Tensor, completion: int) -> torch.Tensor:
    """Log-probabilities [b, completion] of the last `completion` tokens of `tokens` [b, s]
    (prompt then completion) under a model chunk holding the whole model."""
    per_token = chunk(tokens[:, :-1], labels=tokens[:, 1:]).float()
    return -per_token[:, -completion:]


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, ref_logps: torch.Tensor | None = None, beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
              max_completion_length: int | None = None, num_items: float | None = None,
              kl_bias_correction: bool = True) -> tuple[torch.Tensor, dict]:
    """(loss, {kl, clip_ratio}) of one batch; see the module docstring. logps, old_logps,
    ref_logps, mask: [b, t]; advantages: [b]."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPO loss type {loss_type!r} is not one of {LOSS_TYPES}")
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + beta * (kl * ratio if kl_bias_correction else kl)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo normalises by the maximum completion length: give it")
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    else:
        items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = (per_token * mask).sum() / items.clamp(min=1.0)
    tokens = mask.sum().clamp(min=1.0)
    region = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    stats = {"clip_ratio": ((region.to(mask.dtype) * mask).sum() / tokens).item(),
             "kl": ((kl * mask).sum() / tokens).item() if kl is not None else 0.0}
    return loss, stats
