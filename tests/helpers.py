"""Helpers shared by the test modules (no test module imports from another one): in-process
training runs, pipeline-engine pieces, the ZeRO tests' small GPT with its plain
data-parallel reference and ZeRO run, and QK-clip's test steps.

Beside it: `tests/hf_models.py` (small model configs, random Hugging Face reference models and
the checks against them), `tests/tool_runs.py` (the tools/ scripts run in-process, the data
tools' files), `tests/tokenizer_data.py` (tokenizer folders, chat templates and data),
`tests/muon_reference.py` (torch.optim.Muon's reference), `tests/foreign_checkpoints.py` (Megatron-core sources),
`tests/distributed.py` (spawned gloo worlds) and `tests/tolerances.py` (the numeric tolerances).
Spawned test ranks import this module, so transformers, tokenizers and the training stack are
imported inside the functions that need them.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel import collectives as C
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from tests.distributed import all_reduce_each, run_distributed


# ---- In-process training runs ----------------------------------------------------------------


TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000", "--seed", "5"]


def pretrain_gpt(argv, world):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    run = to_run_config(build_parser().parse_args(argv), world_size=world)
    return pretrain(model_provider, run)


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs of a tiny model: threads only add contention (autouse where imported)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def record_hang_start(run_dir: str) -> None:
    """Called by the worker at the moment its fault begins: the reference for the watchdog's delay."""
    with open(os.path.join(run_dir, "hang_start"), "w") as f:
        f.write(repr(time.time()))


def hang_detail(worker, run_dir) -> str:
    """Run a 2-rank world in which rank 1 hangs (recording when, `record_hang_start`); rank 0's
    watchdog must end it within 40 s of the hang's start (a 3 s timeout: the bound is for load, not
    for the watchdog): its message."""
    from megazoo.training.monitor.journal import read_jsonl
    with pytest.raises(RuntimeError, match=r"ranks \[0\] died"):
        run_distributed(worker, 2, str(run_dir), timeout=120)
    hangs = [e for e in read_jsonl(os.path.join(run_dir, "journal.jsonl")) if e["kind"] == "hang"]
    assert hangs and hangs[0]["rank"] == 0, hangs
    with open(os.path.join(run_dir, "hang_start")) as f:
        started = float(f.read())
    assert hangs[0]["time"] - started < 40, (started, hangs[0]["time"])
    return hangs[0]["detail"]


# ---- Pipeline engine runs --------------------------------------------------------------------


def mean_loss_forward(chunk, inp, mb):
    """forward_fn for the engine: the microbatch's mean token loss on the last stage."""
    out = chunk(mb["tokens"] if inp is None else inp,
                labels=mb["labels"] if chunk.post_process else None)
    return out.mean() if chunk.post_process else out


def microbatches(tokens, labels, m: int, dp_topo=None) -> list[dict]:
    """Split the global batch into m microbatches; with `dp_topo`, this DP rank's share only."""
    if dp_topo is not None:
        tokens = tokens.chunk(dp_topo.dp)[dp_topo.dp_rank]
        labels = labels.chunk(dp_topo.dp)[dp_topo.dp_rank]
    return [{"tokens": t, "labels": y} for t, y in zip(tokens.chunk(m), labels.chunk(m))]


def data_parallel_mean(tensors, topo) -> None:
    """What the data-parallel optimizer will do (not the pipeline's job): average over replicas."""
    tensors = list(tensors)
    all_reduce_each(tensors, topo.dp_group)
    for t in tensors:
        t /= topo.dp


# ---- The ZeRO tests' small GPT, its data, the plain data-parallel reference and a ZeRO run ----


GLOBAL_BATCH, SEQ, STEPS = 8, 8, 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, clip_grad=0.5)


def small_gpt(**kw) -> TransformerConfig:
    base = dict(vocab_size=101, hidden_size=48, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=96, max_position_embeddings=16, make_vocab_size_divisible_by=8,
                seed=7)
    return TransformerConfig(**{**base, **kw})


def batch(step: int, topo: ParallelTopology | None = None):
    """Step `step`'s global batch, or this DP rank's share of it."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 101, (GLOBAL_BATCH, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if topo is not None and topo.dp > 1:
        ids, labels = ids.chunk(topo.dp)[topo.dp_rank], labels.chunk(topo.dp)[topo.dp_rank]
    return ids, labels


def dp_mean(value: float, topo) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    C.all_reduce(t, topo.dp_group)
    return t.item() / topo.dp


def reference_adamw(named) -> torch.optim.AdamW:
    """torch AdamW with HYPER over (name, parameter) pairs: decay on matrices only, as the ZeRO
    optimizer's default (the references the parallel runs are compared with)."""
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                               "weight_decay": HYPER["weight_decay"]},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                             lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])


def check_bucket_grads(opt, chunks, topo, ref_grads: dict, tag: str) -> int:
    """This rank's shard of every optimizer bucket equals the same slice of the reference's full
    gradient (by canonical name); returns how many slices it compared."""
    from megazoo.parallel.sharding import local_shard
    where = {id(p): local_shard(p, ref_grads[chunk.canonical_name(n)], topo).reshape(-1)
             for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad}
    checked = 0
    for b in opt.buffers:
        for slot, lo, hi in b.shard_ranges():
            got = b.grad_shard[lo - b.shard_start:hi - b.shard_start]
            want = where[id(slot.param)][lo - slot.offset:hi - slot.offset]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{tag} grad {slot.name}: {m}")
            checked += 1
    return checked


def accumulated_backward(model, ids, labels, shares: int) -> float:
    """Forward and backward of the batch in `shares` equal parts, each loss divided by `shares`
    (the gradient of the batch mean, as data parallelism x microbatches accumulate it); returns
    that mean loss."""
    total = 0.0
    for i, y in zip(ids.chunk(shares), labels.chunk(shares)):
        loss = model(i, labels=y).mean()
        (loss / shares).backward()
        total += loss.item() / shares
    return total


def checked_step(chunks, topo, opt, step: int, microbatches: int, shape, ref_losses, ref_norms,
                 ref_grads: dict | None, tag: str, schedule: str = "1f1b") -> int:
    """One training step of `batch(step, topo)` in `microbatches` through the pipeline and the
    optimizer, its loss and gradient norm checked against the reference's (fp32 1e-5), and with
    `ref_grads` every bucket's gradient before the step; returns the slices compared."""
    from megazoo.training.run.step import forward_backward
    ids, labels = batch(step, topo)
    mbs = [{"tokens": i, "labels": y} for i, y in zip(ids.chunk(microbatches), labels.chunk(microbatches))]
    loss = forward_backward(chunks, mbs, topo, opt, schedule=schedule, shape=shape)
    torch.testing.assert_close(loss, ref_losses[step], rtol=1e-5, atol=1e-5, msg=f"{tag} loss step {step}")
    checked = 0
    if ref_grads is not None:
        opt.grad_sync.finish()
        checked = check_bucket_grads(opt, chunks, topo, ref_grads, tag)
    result = opt.step()
    opt.zero_grad()
    assert not result.skipped, tag
    torch.testing.assert_close(result.grad_norm, ref_norms[step], rtol=1e-5, atol=1e-5,
                               msg=f"{tag} norm {step}")
    return checked


def reference_run(topo: ParallelTopology, cfg: TransformerConfig, steps: int = STEPS):
    """Plain DP with torch.optim.AdamW: (per-step mean losses, full parameters, grad norms)."""
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    named = list(model.named_parameters())
    opt = reference_adamw(named)
    losses, norms = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        loss = model(ids, labels=labels).mean()
        loss.backward()
        for _, p in named:
            C.all_reduce(p.grad, topo.dp_group)
            p.grad /= topo.dp
        params = [p for _, p in named]
        norms.append(torch.nn.utils.clip_grad_norm_(params, HYPER["clip_grad"]).item()
                     if HYPER["clip_grad"] > 0 else
                     torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        opt.step()
        opt.zero_grad()
        losses.append(dp_mean(loss.item(), topo))
    single = ParallelTopology.single()
    return losses, {n: full_tensor(p, single).clone() for n, p in named}, norms


def initial_parameters(cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full parameters before training (weights are seeded by name: the same for every layout)."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, single)
    return {n: full_tensor(p, single).detach().clone() for n, p in model.named_parameters()}


def opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**HYPER, **kw})


def zero_run(topo: ParallelTopology, cfg: TransformerConfig, ocfg: OptimizerConfig,
             steps: int = STEPS, microbatches: int = 1, inject_inf_at: tuple[int, ...] = (),
             on_step=None, dtype: torch.dtype = torch.float32):
    """Train with the ZeRO optimizer, weights in `dtype`: (losses, full fp32 parameters,
    StepResults, optimizer)."""
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, ocfg, dtype)
    losses, results = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        total = 0.0
        for m, (i, y) in enumerate(zip(ids.chunk(microbatches), labels.chunk(microbatches))):
            last = m == microbatches - 1
            with (opt.no_sync() if not last else _null()):
                loss = model(i, labels=y).float().mean()
                if step in inject_inf_at and last:
                    loss = loss * float("inf")  # an fp16 overflow: every gradient becomes inf/NaN
                opt.backward(loss / microbatches)
            total += loss.item() / microbatches
        results.append(opt.step())
        opt.zero_grad()
        losses.append(dp_mean(total, topo))
        if on_step is not None:
            on_step(step, model, opt)
    return losses, full_model_parameters(model, opt, topo), results, opt


def full_model_parameters(model, opt, topo) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 parameter (DP-gathered by the optimizer, TP-gathered here)."""
    dp_full = opt.full_parameters()
    return {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
            for n, p in model.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def topology(**kw) -> ParallelTopology:
    return ParallelTopology.from_config(ParallelConfig(**kw))


# ---- QK-clip ----------------------------------------------------------------------------------


def qk_clip_tau_amid(maxima: list[torch.Tensor]) -> float:
    """A threshold halfway between the two middle heads' maxima (none sits on it): half the
    heads over it."""
    ranked = torch.cat([m.flatten() for m in maxima]).sort().values
    return float(ranked[ranked.numel() // 2 - 1] + ranked[ranked.numel() // 2]) / 2


def qk_clip_forced(model, opt, step, before: list[torch.Tensor], tau: float):
    """Clip once at `tau` on the batch that gave `before` (per layer [heads]; `step(model, opt)`
    runs that batch and returns the reduced maxima) and measure again without a further clip:
    the same maxima while clipping, then the first layer's clipped heads at tau (fp32 1e-5) and
    its others bit for bit (its inputs are unchanged by the clip; later layers' are not).
    Returns the parameters before and after the clip."""
    from megazoo.parallel.zero.qk_clip import QKClipSettings
    over = before[0] > tau
    assert 0 < int(torch.cat(before).gt(tau).sum()) < sum(m.numel() for m in before)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.qk_clip.s = QKClipSettings(threshold=tau)
    assert torch.equal(torch.cat(step(model, opt)), torch.cat(before))  # same batch, same maxima
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.qk_clip.s = QKClipSettings(threshold=1e9)
    after = step(model, opt)  # measured with the clipped weights
    torch.testing.assert_close(after[0][over], torch.full_like(after[0][over], tau),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(after[0][~over], before[0][~over])
    return weights, params


def qk_clip_record(opt, topo) -> tuple[torch.Tensor, int]:
    """The last step's reduced maxima [layers, every head] and the heads clipped, over TP."""
    heads = torch.stack(opt.qk_clip.last_max)  # [layers, this TP rank's heads]
    count = torch.tensor([opt.qk_clip.clipped])
    if topo.tp > 1:
        heads = C.all_gather(heads.contiguous(), topo.tp_group, dim=1)
        count = C.all_reduce(count, topo.tp_group)
    return heads.clone(), int(count)


def qk_clip_train(model, opt, topo, batches):
    """Train on `batches` [(inputs, labels)] recording every step: (full parameters, per step
    the maxima [layers, every head], per step the heads clipped)."""
    maxima, clipped = [], []
    for ids, labels in batches:
        opt.backward(model(ids, labels=labels).mean())
        assert not opt.step().skipped
        opt.zero_grad()
        heads, count = qk_clip_record(opt, topo)
        maxima.append(heads)
        clipped.append(count)
    return full_model_parameters(model, opt, topo), maxima, clipped


def qk_clip_check_run(run, reference, where: str, lr: float) -> str:
    """A layout's `qk_clip_train` result against the unsharded one's: the same heads clipped per
    step, maxima within fp32 1e-5, parameters by the shared rule; `reference` is (initial
    parameters, parameters, maxima, heads clipped, ...)."""
    from tests.tolerances import assert_trained_close
    (got, maxima, clipped), (init, want, want_max, want_clipped) = run, reference[:4]
    assert clipped == want_clipped, (where, clipped, want_clipped)
    for step, (m, w) in enumerate(zip(maxima, want_max)):
        torch.testing.assert_close(m, w, rtol=1e-5, atol=1e-5, msg=f"{where} step {step}")
    dev = assert_trained_close(got, want, init, where, lr)
    return f"{where}: heads clipped per step {clipped}, deviation {dev:.1e}"
