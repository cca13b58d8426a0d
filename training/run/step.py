"""One optimizer step (and one evaluation step) over a global batch of microbatches.

The pipeline engine runs this rank's schedule (with pp = 1 the "no pipelining" schedule is plain
gradient accumulation); the ZeRO optimizer reduces gradients over data parallelism and steps.
MoE layers add their auxiliary losses to the gradients themselves (see models/moe.py), and the
multi-token prediction depths theirs (models/multi_token_prediction.py).
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from megazoo.data.sft_dataset import OnePass
from megazoo.models.moe import set_aux_loss_scale
from megazoo.models.multi_token_prediction import set_mtp_loss_scale
from megazoo.parallel import collectives as C
from megazoo.parallel.context_split import Documents
from megazoo.parallel.pipeline.engine import run_pipeline
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.topology import ParallelTopology

from megazoo.training.run.batches import WholePass, document_flags, microbatches


def activation_shape(topo: ParallelTopology, seq_length: int, micro_batch_size: int, hidden: int):
    """Shape of the tensors passed between pipeline stages: [s/cp, b, h], [s/(cp tp), b, h]
    under SP (a context-parallel rank holds s/cp tokens)."""
    seq = seq_length // topo.cp
    seq = seq // topo.tp if topo.sequence_parallel else seq
    return (seq, micro_batch_size, hidden)


def make_forward_fn(loss_scale: float = 1.0, poison: bool = False, token_norm: float | None = None):
    """forward_fn for the engine: tokens into the first chunk, mean token loss out of the last.

    `poison` multiplies the loss by NaN (a fault-injection drill: every gradient becomes NaN). A
    microbatch with a "loss_mask" averages only over the positions where it is 1; with
    `token_norm` (see `per_token_norm`) it returns its masked sum x token_norm instead.
    """
    factor = loss_scale * (float("nan") if poison else 1.0)

    def forward_fn(chunk, x, mb):
        inputs = mb["tokens"] if chunk.pre_process else x
        docs = documents_of(mb)
        if not chunk.post_process:
            return chunk(inputs, documents=docs) if docs is not None else chunk(inputs)
        extra = {"documents": docs} if docs is not None else {}
        if getattr(chunk, "mtp", None) is not None and "loss_mask" in mb:
            extra["loss_mask"] = mb["loss_mask"]  # masks the multi-token prediction loss alike
        per_token = chunk(inputs, labels=mb["labels"], **extra).float()
        if token_norm is not None:
            mask = mb.get("loss_mask")
            loss = (per_token if mask is None else per_token * mask).sum() * token_norm
        elif "loss_mask" in mb:  # --eod-mask-loss: the mean over the positions that count
            loss = (per_token * mb["loss_mask"]).sum() / mb["loss_mask"].sum().clamp(min=1)
        else:
            loss = per_token.mean()
        return loss * factor if factor != 1.0 else loss
    return forward_fn


def documents_of(mb: dict) -> Documents | None:
    """The packed documents a microbatch carries (training/run/batches.py), or None."""
    if "document_ids" not in mb and "position_ids" not in mb:
        return None
    return Documents(ids=mb.get("document_ids"), positions=mb.get("position_ids"))


def per_token_norm(microbatches: list[dict], topo: ParallelTopology,
                   counted: float | None = None) -> float:
    """The factor that turns a microbatch's summed token loss into its share of the global mean.

    The pipeline divides each microbatch loss by m (microbatches) and the gradient reduction
    divides by D = dp x cp (the ranks holding different tokens), so a microbatch returning
    sum x m D / N, with N the counted tokens of the whole global batch (all microbatches, all
    data- and context-parallel ranks: `counted_tokens`, computed here unless given), makes the
    gradient that of sum over all tokens / N: the mean over the global batch's counted tokens
    (not a mean of microbatch means), and `mean_over_world` of those losses is that same mean.
    """
    total = counted_tokens(microbatches, topo) if counted is None else counted
    return len(microbatches) * topo.dp * topo.cp / total if total > 0 else 0.0


def counted_tokens(microbatches: list[dict], topo: ParallelTopology) -> float:
    """The tokens that enter the loss in the global batch: every data- and context-parallel
    rank's microbatches (their "loss_mask", or every label)."""
    counted = sum(float(mb["loss_mask"].sum()) if "loss_mask" in mb else mb["labels"].numel()
                  for mb in microbatches)
    t = torch.tensor([counted], dtype=torch.float64, device=topo.device)
    C.all_reduce(t, topo.dp_cp_group)
    return t.item()


def mean_over_world(losses: list[torch.Tensor], topo: ParallelTopology) -> float:
    """Mean microbatch loss over every rank that holds a loss (last stages of every DP replica;
    context-parallel ranks hold equal-sized shares of the sequence, so the mean of their means
    is the loss of the whole sequence)."""
    t = torch.zeros(2, dtype=torch.float64, device=topo.device)
    if losses:
        t[0] = torch.stack([l.double() for l in losses]).sum()
        t[1] = len(losses)
    C.all_reduce(t, topo.world_group)
    return (t[0] / t[1]).item() if t[1] > 0 else float("nan")


def forward_backward(chunks, microbatches: list[dict], topo: ParallelTopology, optimizer, *,
                     schedule: str, shape, watchdog=None, poison: bool = False,
                     timings: dict | None = None, per_token_loss: bool = False,
                     forward_fn=None) -> float:
    """Forward and backward over the microbatches; returns the mean loss over the global batch
    (with `per_token_loss`, over its counted tokens: see `per_token_norm`).

    Gradients end up reduced (or being reduced) in the optimizer's buckets, ready for its step.
    `timings["ready"]` receives the moment this rank reached the step's global collective.
    `forward_fn(loss_scale, poison)` makes another loss's forward function (--dpo: training/run/dpo.py).
    """
    steps = build_schedule(schedule if topo.pp > 1 else "no_pipelining", topo.pp, topo.pp_rank,
                           len(microbatches), vpp=len(chunks))
    scale = optimizer.loss_scale
    # MoE auxiliary losses enter backward inside the layers: same scale and averaging as the loss.
    set_aux_loss_scale(chunks, scale / len(microbatches))
    set_mtp_loss_scale(chunks, scale / len(microbatches))  # the multi-token prediction loss too
    guard = watchdog.collective if watchdog is not None else _unmonitored
    norm = None
    if per_token_loss:
        with guard("all_reduce(counted tokens)"):
            norm = per_token_norm(microbatches, topo)
    # Stages 0-1 accumulate microbatch gradients locally and reduce once, after the last one.
    with guard("pipeline forward/backward (p2p, tensor-parallel collectives)"), optimizer.no_sync():
        losses = run_pipeline(steps, chunks, microbatches, topo, shape,
                              optimizer.dtype, forward_fn(scale, poison) if forward_fn is not None
                              else make_forward_fn(scale, poison, norm))
    optimizer.grad_sync.launch_remaining()
    if timings is not None:
        timings["ready"] = time.perf_counter()
    with guard("all_reduce(loss)"):
        return mean_over_world([l / scale for l in losses], topo)


@contextlib.contextmanager
def _unmonitored(_what: str):
    yield


def eval_step(chunks, microbatches: list[dict], topo: ParallelTopology, *, shape, dtype,
              per_token_loss: bool = False, forward_fn=None) -> tuple[float, float]:
    """(mean loss over the microbatches, forward only (no graph kept), and the batch's weight in
    an evaluation's mean: its counted tokens with `per_token_loss`, else 1)."""
    counted = counted_tokens(microbatches, topo) if per_token_loss else 1.0
    norm = per_token_norm(microbatches, topo, counted) if per_token_loss else None
    steps = build_schedule("forward_only", topo.pp, topo.pp_rank, len(microbatches), vpp=len(chunks))
    for c in chunks:
        c.eval()
    try:
        losses = run_pipeline(steps, chunks, microbatches, topo, shape, dtype,
                              forward_fn(1.0, False) if forward_fn is not None
                              else make_forward_fn(token_norm=norm))
    finally:
        for c in chunks:
            c.train()
    return mean_over_world(losses, topo), counted


def evaluate(chunks, dataset, topo: ParallelTopology, run, shape, dtype, *, watchdog=None,
             interrupted=None, forward_fn=None, consumed_samples: int = 0) -> tuple[float, int, int]:
    """Validation loss over --eval-iters global batches from sample `consumed_samples` of the
    validation set (wrapping around its end), how many batches it took and how many it was to
    take. `interrupted()` (collective, the same on every rank) is asked after each batch: True
    ends the evaluation early (a stop request).

    With the per-token loss (--sft, --calculate-per-token-loss) the loss is the mean over every
    counted token of those batches (each batch weighed by its tokens), and --sft reads each
    held-out conversation at most once: at most --eval-iters batches, fewer when the validation
    conversations fill fewer (the last one filled with samples that count no token).
    --full-validation reads every sample of the set once (ceil(samples / global batch) batches,
    the last one filled alike) and takes the mean over every counted token, as Megatron-LM sums
    each sample's loss and token count over the whole set.
    `forward_fn` as in `forward_backward` (--dpo: the preference loss over held-out pairs)."""
    mbs, gbs = run.schedule.micro_batch_size, run.schedule.global_batch_size
    planned, full = run.logging.eval_iters, run.data.full_validation
    per_token_loss = run.data.per_token_loss or full
    if run.data.sft or full:
        whole = math.ceil(len(dataset) / gbs)
        planned = whole if full else min(planned, whole)
        dataset = OnePass(dataset, planned * gbs) if run.data.sft else WholePass(dataset, planned * gbs)
    it = microbatches(dataset, consumed_samples=consumed_samples, micro_batch_size=mbs,
                      dp_rank=topo.dp_rank,
                      dp=topo.dp, device=topo.device, eod_mask_token=run.data.eod_mask_token,
                      cp=topo.cp, cp_rank=topo.cp_rank, documents=document_flags(run.data),
                      pad_mask_token=run.data.pad_mask_token)
    per_step = gbs // (mbs * topo.dp)
    guard = watchdog.collective if watchdog is not None else _unmonitored
    total, weight, batches = 0.0, 0.0, 0
    for _ in range(planned):
        with guard("evaluation batch (forward, all_reduce(loss))"):
            loss, counted = eval_step(chunks, [next(it) for _ in range(per_step)], topo, shape=shape,
                                      dtype=dtype, per_token_loss=per_token_loss,
                                      forward_fn=forward_fn)
            total, weight, batches = total + loss * counted, weight + counted, batches + 1
            if interrupted is not None and interrupted():
                break
    return (total / weight if weight > 0 else float("nan")), batches, planned
