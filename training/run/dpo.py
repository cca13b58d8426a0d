"""Direct preference optimisation (Rafailov et al. 2023) over microbatches of pairs.

A microbatch holds whole pairs (data/preference.py): sample 2j is a pair's chosen sequence, 2j + 1
its rejected one. Each sequence's log-probability is the sum over its reply tokens (the loss
mask) of the per-token log-probabilities the model's vocabulary-parallel head gives (minus its
per-token loss), for the policy and, without gradients, for the reference: the base with the
adapters off under LoRA, else a frozen copy loaded from --dpo-reference (or --load with
--finetune). With z = (policy - reference) of chosen minus that of rejected, the losses are TRL's:

    sigmoid  -log sigmoid(beta z)
    robust   (-(1 - e) log sigmoid(beta z) + e log sigmoid(-beta z)) / (1 - 2e), e = label smoothing
    ipo      (z' - 1 / (2 beta))^2, z' with each log ratio divided by its reply's token count

averaged over the microbatch's pairs; microbatches hold equally many pairs, so the step's loss
is the mean over the global batch's pairs. The rewards are beta x each log ratio; the step's
chosen and rejected rewards, margins, accuracy (chosen reward above rejected) and policy
log-probabilities are means over the global batch's pairs (`PreferenceStats`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megazoo.parallel import collectives as C
from megazoo.parallel.lora import adapters_disabled

from megazoo.training.config.run_config import DPOSettings

FIELDS = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracy",
          "logps_chosen", "logps_rejected")


def pair_losses(settings: DPOSettings, chosen: torch.Tensor, rejected: torch.Tensor,
                chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor) -> torch.Tensor:
    """Per-pair losses from the log ratios (policy - reference) of the chosen and rejected replies."""
    beta, e = settings.beta, settings.label_smoothing
    z = chosen - rejected
    if settings.loss_type == "sigmoid":
        return -F.logsigmoid(beta * z)
    if settings.loss_type == "robust":
        return (-(1 - e) * F.logsigmoid(beta * z) + e * F.logsigmoid(-beta * z)) / (1 - 2 * e)
    if settings.loss_type == "ipo":
        avg = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        return (avg - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {settings.loss_type!r}")


class PreferenceStats:
    """Sums over one step's pairs on this rank; `reduce` gives the global batch's means."""

    def __init__(self):
        self.sums = torch.zeros(len(FIELDS) + 1, dtype=torch.float64)

    def add(self, beta: float, chosen, rejected, logps_chosen, logps_rejected) -> None:
        rc, rr = beta * chosen.double(), beta * rejected.double()
        self.sums += torch.stack([rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).double().sum(),
                                  logps_chosen.double().sum(), logps_rejected.double().sum(),
                                  torch.tensor(float(len(rc)), dtype=torch.float64)]).cpu()

    def reduce(self, topo) -> dict[str, float]:
        """Collective over data parallelism (tensor-parallel ranks hold the same pairs)."""
        t = self.sums.clone().to(topo.device)
        C.all_reduce(t, topo.dp_cp_group)
        t = t.cpu()
        self.sums.zero_()
        n = t[-1].item()
        return {k: (t[i] / n).item() if n else float("nan") for i, k in enumerate(FIELDS)}


class Reference:
    """Per-token losses of the reference model on a microbatch (no gradients)."""

    def __init__(self, chunks, frozen=None):
        self.chunks, self.frozen = chunks, frozen  # frozen: the copy's chunks (None: LoRA's base)

    @torch.no_grad()
    def per_token(self, chunk, tokens, labels) -> torch.Tensor:
        if self.frozen is None:
            with adapters_disabled([chunk]):
                return chunk(tokens, labels=labels)
        return self.frozen[self.chunks.index(chunk)](tokens, labels=labels)


def build_reference(run, topo, chunks, model_provider, path: str | None = None) -> Reference:
    """LoRA: the training chunks with their adapters off; else a frozen copy of the reference
    checkpoint `path` (default --dpo's; any layout), built like the training chunks."""
    if run.lora is not None:
        return Reference(chunks)
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.reshard import load_weights
    specs = topo.config.chunk_specs(run.model.num_layers, topo.pp_rank)
    frozen = [model_provider(run.model, topo, rng=None, **spec.kwargs()) for spec in specs]
    for c in frozen:
        c.requires_grad_(False)
    load_weights(ckpt.require_verified(ckpt.resolve(path or run.dpo.reference)), frozen, topo)
    return Reference(chunks, frozen)


def make_dpo_forward_fn(settings: DPOSettings, reference: Reference, stats: PreferenceStats,
                        loss_scale: float = 1.0, poison: bool = False):
    """forward_fn for the pipeline engine (one stage): a microbatch of pairs -> its mean loss."""
    factor = loss_scale * (float("nan") if poison else 1.0)

    def forward_fn(chunk, x, mb):
        tokens, labels, mask = mb["tokens"], mb["labels"], mb["loss_mask"]
        logps = -(chunk(tokens, labels=labels).float() * mask).sum(-1)
        ref = -(reference.per_token(chunk, tokens, labels).float() * mask).sum(-1)
        ratio = logps - ref
        counts = mask.sum(-1)
        losses = pair_losses(settings, ratio[0::2], ratio[1::2], counts[0::2], counts[1::2])
        stats.add(settings.beta, ratio[0::2].detach(), ratio[1::2].detach(),
                  logps[0::2].detach(), logps[1::2].detach())
        loss = losses.mean()
        return loss * factor if factor != 1.0 else loss
    return forward_fn
