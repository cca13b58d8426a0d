"""GRPO's online step: sample a group of completions per prompt with the training weights
(models/generation.py, any tensor-parallel layout: TP rank 0's tokens are broadcast), score them
with a reward function, and take the clipped policy-gradient loss of training/run/grpo.py.

One prompt's group is one forward/backward (prompts of different lengths need no padding: the
KV cache has no padding mask). Each group's loss is weighted so the step's gradient is the
gradient of `grpo_loss` over the whole batch: dapo and bnpo divide by the batch's completion
tokens, grpo and dr_grpo average over the batch's groups. One update per generation batch, as
TRL's default (num_iterations 1): the old log-probabilities are the policy's own, detached, so
the ratio is 1 and the clip fraction 0 unless the policy changes between sampling and the loss.
"""
from __future__ import annotations

import importlib
import time

import torch

from megazoo.models.generation import SamplingConfig, generate
from megazoo.parallel import collectives as C
from megazoo.training.config.run_config import GRPOSettings
from megazoo.training.run.grpo import completion_logps, group_advantages, grpo_loss


def load_reward(spec: str):
    """`module:function` -> the function; ValueError naming the flag otherwise."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--reward {spec!r}: give module:function (e.g. examples.grpo.rewards:add)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is not callable")
    return fn


def sample_group(chunk, topo, prompt: list[int], settings: GRPOSettings, eos: tuple[int, ...],
                 generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [G, P + T], completion mask [G, T]); T = the max completion length, the tail
    after a sequence's first eos (kept, counted) padded with eos and masked."""
    cfg = SamplingConfig(greedy=False, temperature=settings.temperature, top_p=settings.top_p,
                         eos_id=eos or None)
    G, T = settings.num_generations, settings.max_completion_length
    ids = torch.tensor([prompt] * G, dtype=torch.long, device=topo.device)
    out = generate(chunk, topo, ids, T, cfg, generator)
    completion = out[:, len(prompt):]
    pad = eos[0] if eos else 0
    if completion.shape[1] < T:
        completion = torch.cat([completion, completion.new_full((G, T - completion.shape[1]), pad)], 1)
    mask = torch.ones(G, T, dtype=torch.long, device=completion.device)
    if eos:
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))
        after = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first eos
        mask = (~after).long()
    return torch.cat([ids, completion], 1), mask


def grpo_step(chunk, topo, records: list[dict], prompts: list[list[int]], reward_fn, decode,
              settings: GRPOSettings, eos: tuple[int, ...], reference=None, generators=None,
              backward=None) -> dict:
    """Sample, score and backpropagate this data-parallel rank's share of one batch (every
    rank the same number of prompts; gradients accumulate in `chunk`, summed over data
    parallelism, so the caller steps its optimizer). records[i]: the prompt's jsonl record (its
    other fields go to the reward function); decode: token ids -> text; generators[i]: the
    prompt's sampling generator (one per prompt: the samples do not depend on the layout).
    `backward(loss)`: how each group's loss enters the gradients (default: `loss.backward()`,
    then the gradients summed over data parallelism here; the trainer passes its optimizer's,
    which reduces them itself). Returns the step's metrics over the whole batch."""
    t0 = time.perf_counter()
    generators = generators or [None] * len(prompts)
    groups = [sample_group(chunk, topo, p, settings, eos, g) for p, g in zip(prompts, generators)]
    gen_time = time.perf_counter() - t0
    G, T = settings.num_generations, settings.max_completion_length
    texts, rep = [], []
    for rec, p, (tokens, mask) in zip(records, prompts, groups):
        for row, m in zip(tokens, mask):
            texts.append(decode(row[len(p):][m.bool()].tolist()))
            rep.append(rec)
    keys = sorted({k for r in records for k in r if k not in ("prompt", "messages")})
    extra = {k: [r.get(k) for r in rep] for k in keys}
    prompt_texts = [r.get("prompt", r.get("messages")) for r in rep]
    rewards = torch.tensor([float(x) for x in reward_fn(prompts=prompt_texts, completions=texts, **extra)],
                           dtype=torch.float32)
    if rewards.numel() != len(texts):
        raise ValueError(f"--reward returned {rewards.numel()} values for {len(texts)} completions")
    advantages = group_advantages(rewards, G, settings.scale_rewards).to(topo.device)
    t1 = time.perf_counter()
    counts = torch.tensor([sum(float(m.sum()) for _, m in groups), float(len(groups))], dtype=torch.float64,
                          device=topo.device)
    C.all_reduce(counts, topo.dp_group)
    tokens_total, n_groups = counts.tolist()
    loss_sum, kl_sum, clip_sum = 0.0, 0.0, 0.0
    for i, (tokens, mask) in enumerate(groups):
        logps = completion_logps(chunk, tokens, T)
        ref = None
        if settings.beta != 0.0:
            ref = -reference.per_token(chunk, tokens[:, :-1], tokens[:, 1:]).float()[:, -T:]
        adv = advantages[i * G:(i + 1) * G]
        if settings.loss_type in ("dapo", "bnpo"):  # divided by the batch's completion tokens
            loss, stats = grpo_loss(logps, logps.detach(), adv, mask, ref_logps=ref, beta=settings.beta,
                                    epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high,
                                    loss_type="dapo", num_items=tokens_total)
        else:  # a mean over sequences: each group's mean weighs 1 / groups
            loss, stats = grpo_loss(logps, logps.detach(), adv, mask, ref_logps=ref, beta=settings.beta,
                                    epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high,
                                    loss_type=settings.loss_type, max_completion_length=T)
            loss = loss / n_groups
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        share = float(mask.sum()) / max(tokens_total, 1.0)
        loss_sum += loss.item()
        kl_sum += stats["kl"] * share
        clip_sum += stats["clip_ratio"] * share
    for p in chunk.parameters() if backward is None else ():  # the sum of the ranks' parts
        if p.grad is not None:
            C.all_reduce(p.grad, topo.dp_group)
    sums = torch.tensor([loss_sum, kl_sum, clip_sum], dtype=torch.float64, device=topo.device)
    loss_sum, kl_sum, clip_sum = C.all_reduce(sums, topo.dp_group).tolist()
    rewards = C.all_gather(rewards.to(topo.device), topo.dp_group).cpu()
    lengths = C.all_gather(torch.cat([m.sum(1) for _, m in groups]).float(), topo.dp_group).cpu()
    return {"loss": loss_sum, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "kl": kl_sum, "clip_ratio": clip_sum, "completion_length_mean": lengths.mean().item(),
            "completion_length_max": lengths.max().item(), "generation_time": gen_time,
            "training_time": time.perf_counter() - t1,
            "_batch": dict(groups=groups, rewards=rewards, advantages=advantages, texts=texts)}
