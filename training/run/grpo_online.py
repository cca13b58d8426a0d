"""GRPO's online step: sample a group of completions per prompt with the training weights
(models/generation.py, any tensor-parallel layout: TP rank 0's tokens are broadcast), score them
with a reward function, and take the clipped policy-gradient loss of training/run/grpo.py.

One prompt's group is one forward/backward (prompts of different lengths need no padding: the
KV cache has no padding mask). Each group's loss is weighted so the step's gradient is the
gradient of `grpo_loss` over the whole batch: dapo and bnpo divide by the batch's completion
tokens, grpo and dr_grpo average over the batch's groups. One update per generation batch, as
TRL's default (num_iterations 1): the old log-probabilities are the policy's own, detached, so
the ratio is 1 and the clip fraction 0 unless the policy changes between sampling and the loss.
With num_iterations > 1 (TRL's), the sampling policy's log-probabilities are kept with the batch
and each of the num_iterations updates on it takes its ratio against them.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
import time

import torch

from megazoo.models.generation import SamplingConfig, generate
from megazoo.parallel import collectives as C
from megazoo.training.config.run_config import GRPOSettings
from megazoo.training.run.grpo import completion_logps, group_advantages, grpo_loss

logger = logging.getLogger(__name__)


def load_rewards(spec: str) -> list:
    """`module:function[,module:function...]` -> the functions (--reward)."""
    return [load_reward(part.strip()) for part in spec.split(",") if part.strip()]


def load_reward(spec: str):
    """`module:function` -> the function; ValueError naming the flag otherwise."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--reward {spec!r}: give module:function (e.g. examples.grpo.rewards:add)")
    try:
        fn = getattr(import_reward_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec!r}: {e} (the module is imported by name: a file in the "
                         f"working directory, or a folder on PYTHONPATH)") from e
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is not callable")
    return fn


def check_reward_fields(fns: list, records: list[dict], path: str) -> None:
    """Each reward function's required arguments are among what it will get (prompts,
    completions and the records' fields); ValueError naming the function and the file otherwise."""
    given = {"prompts", "completions"} | {k for r in records for k in r if k not in ("prompt", "messages")}
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            continue
        missing = [p.name for p in params if p.default is p.empty and p.name not in given
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__name__', fn)}"
            raise ValueError(f"--reward {name} needs {', '.join(map(repr, missing))}, a field no record "
                             f"of --grpo-prompts {path} has; add it to the records (each field reaches "
                             f"the reward by name) or give the argument a default")


def import_reward_module(module: str):
    """`module`, from sys.path or else from the working directory, as TRL's scripts import their
    reward functions (the script's own folder is on sys.path, the directory it runs in is not)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = module.split(".")[0]
        if e.name != top or not (os.path.exists(os.path.join(cwd, top + ".py"))
                                                    or os.path.isdir(os.path.join(cwd, top))):
            raise
        # the top-level module or package found in the working directory alone (sys.path is
        # left as it is); a dotted name's submodules then resolve through the package's __path__
        spec = importlib.machinery.PathFinder.find_spec(top, [cwd])
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[top] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[top]
            raise
        logger.info("--reward: %s imported from the working directory %s", module, cwd)
        return importlib.import_module(module)


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


def combine_rewards(per_func: torch.Tensor, weights=None) -> torch.Tensor:
    """TRL's reward_weights: per_func [n completions, n functions] -> the weighted sum [n]
    (a function's NaN, "no opinion on this completion", counts as 0; weights default to 1)."""
    w = torch.ones(per_func.shape[1]) if weights is None else torch.as_tensor(weights, dtype=per_func.dtype)
    if w.numel() != per_func.shape[1]:
        raise ValueError(f"--reward-weights gives {w.numel()} weights for {per_func.shape[1]} --reward "
                         f"functions: give one per function")
    return (per_func * w.unsqueeze(0)).nansum(1)


def truncated(mask: torch.Tensor, tokens: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """[G] bool: completions (tokens [G, T], mask [G, T]) with no eos among their kept tokens."""
    if not eos:
        return torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    is_eos = torch.isin(tokens, torch.tensor(eos, device=tokens.device)) & mask.bool()
    return ~is_eos.any(1)


def sample_batch(chunk, topo, records: list[dict], prompts: list[list[int]], reward_fns, decode,
                 settings: GRPOSettings, eos: tuple[int, ...], generators=None) -> dict:
    """Sample and score this data-parallel rank's share of one generation batch: groups (tokens,
    loss mask), rewards (weighted over reward_fns: one function or a list), advantages, and with
    settings.num_iterations > 1 the sampling policy's log-probabilities (`old`, reused by every
    update on this batch, so the ratio of the later updates is real)."""
    t0 = time.perf_counter()
    generators = generators or [None] * len(prompts)
    groups = [sample_group(chunk, topo, p, settings, eos, g) for p, g in zip(prompts, generators)]
    G, T = settings.num_generations, settings.max_completion_length
    texts, rep = [], []
    for rec, p, (tokens, mask) in zip(records, prompts, groups):
        for row, m in zip(tokens, mask):
            texts.append(decode(row[len(p):][m.bool()].tolist()))
            rep.append(rec)
    keys = sorted({k for r in records for k in r if k not in ("prompt", "messages")})
    extra = {k: [r.get(k) for r in rep] for k in keys}
    prompt_texts = [r.get("prompt", r.get("messages")) for r in rep]
    fns = reward_fns if isinstance(reward_fns, (list, tuple)) else [reward_fns]
    columns = []
    for fn in fns:
        col = [float("nan") if x is None else float(x)
               for x in fn(prompts=prompt_texts, completions=texts, **extra)]
        if len(col) != len(texts):
            raise ValueError(f"--reward returned {len(col)} values for {len(texts)} completions")
        columns.append(col)
    per_func = torch.tensor(columns, dtype=torch.float32).T
    unscored = torch.isnan(per_func).all(1)
    if unscored.any():
        i = int(unscored.nonzero()[0])
        raise ValueError(f"--reward: every function returned None for completion {texts[i]!r}: "
                         f"give at least one reward for each completion")
    rewards = combine_rewards(per_func, getattr(settings, "reward_weights", None))
    advantages = group_advantages(rewards, G, settings.scale_rewards).to(topo.device)
    lengths = torch.cat([m.sum(1) for _, m in groups]).float()
    n_truncated = 0
    if getattr(settings, "mask_truncated_completions", False):  # TRL: no loss on a cut-off completion
        masked = []
        for tokens, mask in groups:
            cut = truncated(mask, tokens[:, -T:], eos)
            n_truncated += int(cut.sum())
            masked.append((tokens, mask * (~cut).long().unsqueeze(1)))
        groups = masked
    old = None
    if getattr(settings, "num_iterations", 1) > 1:
        with torch.no_grad():
            old = [completion_logps(chunk, tokens, T) for tokens, _ in groups]
    return dict(groups=groups, rewards=rewards, per_func=per_func, advantages=advantages, texts=texts,
                old=old, lengths=lengths, truncated=n_truncated,
                generation_time=time.perf_counter() - t0)


def train_batch(chunk, topo, batch: dict, settings: GRPOSettings, reference=None, backward=None) -> dict:
    """Backpropagate the clipped loss of a sampled batch (sample_batch) into `chunk`'s gradients;
    see grpo_step. Returns the update's metrics over the whole batch."""
    t1 = time.perf_counter()
    G, T = settings.num_generations, settings.max_completion_length
    groups, advantages = batch["groups"], batch["advantages"]
    counts = torch.tensor([sum(float(m.sum()) for _, m in groups), float(len(groups))], dtype=torch.float64,
                          device=topo.device)
    C.all_reduce(counts, topo.dp_group)
    tokens_total, n_groups = counts.tolist()
    loss_sum, kl_sum, clip_sum = 0.0, 0.0, 0.0
    for i, (tokens, mask) in enumerate(groups):
        logps = completion_logps(chunk, tokens, T)
        old = logps.detach() if batch["old"] is None else batch["old"][i]
        ref = None
        if settings.beta != 0.0:
            ref = -reference.per_token(chunk, tokens[:, :-1], tokens[:, 1:]).float()[:, -T:]
        adv = advantages[i * G:(i + 1) * G]
        if settings.loss_type in ("dapo", "bnpo"):  # divided by the batch's completion tokens
            loss, stats = grpo_loss(logps, old, adv, mask, ref_logps=ref, beta=settings.beta,
                                    epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high,
                                    loss_type="dapo", num_items=tokens_total)
        else:  # a mean over sequences: each group's mean weighs 1 / groups
            loss, stats = grpo_loss(logps, old, adv, mask, ref_logps=ref, beta=settings.beta,
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
    sums = torch.tensor([loss_sum, kl_sum, clip_sum, float(batch["truncated"])], dtype=torch.float64,
                        device=topo.device)
    loss_sum, kl_sum, clip_sum, n_truncated = C.all_reduce(sums, topo.dp_group).tolist()
    rewards = C.all_gather(batch["rewards"].to(topo.device), topo.dp_group).cpu()
    lengths = C.all_gather(batch["lengths"].to(topo.device), topo.dp_group).cpu()
    metrics = {"loss": loss_sum, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
               "kl": kl_sum, "clip_ratio": clip_sum, "completion_length_mean": lengths.mean().item(),
               "completion_length_max": lengths.max().item(),
               "generation_time": batch["generation_time"], "training_time": time.perf_counter() - t1,
               "_batch": dict(batch, rewards=rewards)}
    if batch["per_func"].shape[1] > 1:  # each function's mean, as TRL logs rewards/<name>/mean
        per_func = C.all_gather(batch["per_func"].to(topo.device), topo.dp_group).cpu()
        for j in range(per_func.shape[1]):
            metrics[f"reward_{j}_mean"] = per_func[:, j].nanmean().item()
    if getattr(settings, "mask_truncated_completions", False):
        metrics["truncated_fraction"] = n_truncated / lengths.numel()
    return metrics


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
    batch = sample_batch(chunk, topo, records, prompts, reward_fn, decode, settings, eos, generators)
    return train_batch(chunk, topo, batch, settings, reference, backward)
