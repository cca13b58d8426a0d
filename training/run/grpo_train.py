"""GRPO as a mode of the trainer (--grpo-prompts): each iteration samples a group of completions
for each of the step's prompts with the training weights, scores them with --reward and
backpropagates the clipped loss (training/run/grpo_online.py) into the ZeRO optimizer's
gradient buckets; the trainer then steps, logs, evaluates nothing and checkpoints as in any run.

A step takes --global-batch-size / --num-generations prompts (--global-batch-size counts
completions, as TRL's generation batch), in file order from the iteration's position (cycling),
data-parallel ranks taking equal consecutive shares; each prompt is sampled with its own
generator seeded from --seed and its position in the run, so the samples depend neither on the
layout nor on where a run was resumed. The optimizer averages gradients over data parallelism:
each rank's loss is multiplied by the data-parallel size, so the step's gradient is that of the
whole batch's loss. With --num-iterations k, a generation batch is sampled every k iterations
(prompts advance per generation batch) and each of the k updates reuses it with the sampling
policy's log-probabilities as the old ones (TRL's num_iterations).
"""
from __future__ import annotations

import logging

import torch

from megazoo.data.tokenizers import build_tokenizer
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.tokenizer import eos_token_ids
from megazoo.training.config.errors import ArgumentError
from megazoo.training.run.dpo import Reference, build_reference
from megazoo.training.run.grpo_online import check_reward_fields, load_rewards, sample_batch, train_batch
from megazoo.training.run.grpo_prompts import read_prompts

logger = logging.getLogger(__name__)

SEED_STRIDE = 1_000_003  # a prompt's generator: seed x stride + its position in the run


def run_eos(run, tok) -> tuple[int, ...]:
    """Where sampling stops: --load's recorded eos ids (generation_config.json's at import),
    else the tokenizer's end of document."""
    if run.checkpoint.load:
        try:
            folder = ckpt.resolve(run.checkpoint.load)
            ids = eos_token_ids(folder, ckpt.read_meta(folder))
            if ids:
                return tuple(ids)
        except ckpt.CheckpointError:
            pass
    return (tok.eod,)


class GRPOTraining:
    """The run's prompts, reward, tokenizer, eos and KL reference; `forward_backward` is one
    iteration's sampling, scoring and backward."""

    def __init__(self, run, topo, chunks, model_provider):
        try:  # a bad prompts file, reward or length: one line naming the flag (entry.USER_ERRORS)
            self._read(run, topo)
        except ArgumentError:
            raise
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        settings, self.chunks = self.settings, chunks
        self.reference = None
        if settings.beta > 0:
            if run.lora is not None:
                self.reference = Reference(chunks)  # the base: the adapters off, no copy
            else:
                self.reference = build_reference(run, topo, chunks, model_provider,
                                                 settings.reference)
        self.history: list[dict] = []
        self._batch: tuple[int, dict] | None = None  # (generation index, its sampled batch)
        if topo.rank == 0:
            logger.info("GRPO: %d prompts from %s, %d per step x %d completions (at most %d tokens); "
                        "reward %s; KL %s", len(self.records), settings.prompts, self.per_step,
                        settings.num_generations, settings.max_completion_length, settings.reward,
                        "off" if self.reference is None else
                        f"beta {settings.beta} to the base with the adapters off" if run.lora
                        else f"beta {settings.beta} to {settings.reference}")

    def _read(self, run, topo) -> None:
        settings = self.settings = run.grpo
        d = run.data
        self.tok = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                   tokenizer_model=d.tokenizer_model)
        self.records, self.prompts = read_prompts(settings.prompts, self.tok, settings.chat)
        self.reward_fns = load_rewards(settings.reward)
        check_reward_fields(self.reward_fns, self.records, settings.prompts)
        self.eos = run_eos(run, self.tok)
        model = run.model
        longest = max(map(len, self.prompts)) + settings.max_completion_length
        if model.position_embedding == "learned" and longest > model.max_position_embeddings:
            raise ValueError(f"--grpo-prompts {settings.prompts}: the longest prompt plus "
                             f"--max-completion-length is {longest} tokens, beyond the model's "
                             f"{model.max_position_embeddings} learned positions; shorten them")
        self.topo, self.seed = topo, run.seed
        self.per_step = run.schedule.global_batch_size // settings.num_generations
        if self.per_step % topo.dp:
            raise ValueError(f"--global-batch-size {run.schedule.global_batch_size} / --num-generations "
                             f"{settings.num_generations} = {self.per_step} prompts per step: "
                             f"the data-parallel size {topo.dp} must divide it")

    def forward_backward(self, iteration: int, optimizer, poison: bool = False) -> float:
        """Iteration `iteration` (1-based): sample and score (every --num-iterations iterations;
        between, the same batch again), backward into the optimizer's buckets (reduced over data
        parallelism, launched before this returns); returns the loss of the whole batch and
        keeps its metrics in `history`."""
        topo, n = self.topo, self.per_step
        gen = (iteration - 1) // self.settings.num_iterations
        if self._batch is None or self._batch[0] != gen:
            if (iteration - 1) % self.settings.num_iterations and topo.rank == 0:
                logger.warning("GRPO: iteration %d resumes inside a generation batch of "
                               "--num-iterations %d: sampling it anew with the current weights",
                               iteration, self.settings.num_iterations)
            share = n // topo.dp
            slots = [gen * n + topo.dp_rank * share + j for j in range(share)]
            idx = [k % len(self.records) for k in slots]
            generators = [torch.Generator(device=topo.device).manual_seed(self.seed * SEED_STRIDE + k)
                          for k in slots]
            self._batch = (gen, sample_batch(self.chunks[0], topo, [self.records[i] for i in idx],
                                             [self.prompts[i] for i in idx], self.reward_fns,
                                             self.tok.decode, self.settings, self.eos, generators))
        factor = optimizer.loss_scale * topo.dp * (float("nan") if poison else 1.0)

        def backward(loss):
            (loss * factor).backward()

        with optimizer.no_sync():  # stages 0-1: one reduction after the last group
            metrics = train_batch(self.chunks[0], topo, self._batch[1], self.settings, self.reference,
                                  backward=backward)
        optimizer.grad_sync.launch_remaining()
        metrics.pop("_batch")
        self.history.append(metrics)
        return metrics["loss"] * (float("nan") if poison else 1.0)
