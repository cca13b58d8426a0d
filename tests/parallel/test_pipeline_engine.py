"""The pipeline engine in gloo worlds, against one process running the whole model.

A toy language model (embedding tied to the head, residual tanh layers, cross-entropy) keeps the
worlds fast; `test_pipeline_gpt.py` runs the same comparison on the real GPT model. Every case
checks the loss, every parameter gradient (tied pair included) and the activations held.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import activation_bound, build_schedule
from megazoo.parallel.param_spec import set_spec
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from tests.distributed import sum_tied_embedding_grads
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed
from tests.helpers import data_parallel_mean, mean_loss_forward, microbatches

VOCAB, HIDDEN, SEQ, LAYERS, BATCH = 11, 8, 5, 8, 8


def _init(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.5


class ToyLayer(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.weight = nn.Parameter(_init((HIDDEN, HIDDEN), 1000 + index))
        self.bias = nn.Parameter(_init((HIDDEN,), 2000 + index))

    def forward(self, x):
        # Residual add last, like a transformer layer: the output itself is not saved.
        return x + torch.tanh(F.linear(x, self.weight, self.bias))


class ToyChunk(nn.Module):
    """Layers [start, stop) of the toy model; deterministic init per global layer index."""

    def __init__(self, layer_range, pre_process=True, post_process=True):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.layers = nn.ModuleDict({str(i): ToyLayer(i) for i in range(*layer_range)})
        if pre_process:
            self.embedding = nn.Parameter(_init((VOCAB, HIDDEN), 7))
            set_spec(self.embedding, tied_embedding=True)
        if post_process and not pre_process:
            self.head = nn.Parameter(torch.zeros(VOCAB, HIDDEN))  # filled by the broadcast
            set_spec(self.head, tied_embedding=True)

    def forward(self, x, labels=None):
        h = F.embedding(x, self.embedding).transpose(0, 1) if self.pre_process else x
        for layer in self.layers.values():
            h = layer(h)
        if not self.post_process:
            return h
        logits = h @ (self.embedding if self.pre_process else self.head).t()  # [s, b, v]
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), labels.reshape(-1),
                               reduction="none").view(labels.shape)


def global_batch(seed: int = 0, batch: int = BATCH):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference():
    """Loss and gradients of the whole model, one process, full batch."""
    model = ToyChunk((0, LAYERS))
    tokens, labels = global_batch()
    loss = model(tokens, labels).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


# (schedule, pp, vpp, microbatches, dp_split, uneven first/last stage layers)
CASES_4 = [
    ("1f1b", 4, 1, 8, False, None),
    ("interleaved", 4, 2, 8, False, None),
    ("interleaved", 4, 2, 4, False, None),  # m == pp: all warm-up on rank 0
    ("gpipe", 4, 1, 4, False, None),
    ("no_pipelining", 4, 1, 2, False, None),
    ("1f1b", 4, 1, 2, False, None),  # fewer microbatches than stages
    ("1f1b", 4, 1, 4, False, (1, 3)),  # uneven: 1 layer first, 3 last, 2 + 2 between
    ("1f1b", 2, 1, 4, False, None),  # world 4 = 2 pipelines, both on the full batch
    ("interleaved", 2, 2, 4, False, None),
    ("1f1b", 2, 1, 4, True, None),  # dp = 2: each pipeline takes half the batch
    ("interleaved", 2, 2, 4, True, None),
    ("forward_only", 4, 2, 4, False, None),  # evaluation: loss only, no graph, no gradients
    ("forward_only", 2, 1, 4, True, None),
]


def _pipeline_worker(rank, cases):
    results = []
    for name, pp, vpp, m, dp_split, uneven in cases:
        topo = ParallelTopology.from_config(ParallelConfig(pp=pp, vpp=vpp))
        first, last = uneven or (None, None)
        specs = partition(LAYERS, pp, vpp, first_stage_layers=first,
                          last_stage_layers=last)[topo.pp_rank]
        chunks = [ToyChunk(s.layer_range, s.pre_process, s.post_process) for s in specs]
        broadcast_tied_embedding(chunks, topo)
        mbs = microbatches(*global_batch(), m, topo if dp_split else None)
        stats = PipelineStats()
        steps = build_schedule(name, pp, topo.pp_rank, m, vpp)
        shape = (SEQ, mbs[0]["tokens"].shape[0], HIDDEN)
        losses = run_pipeline(steps, chunks, mbs, topo, shape, torch.float32, mean_loss_forward,
                              stats=stats)
        loss = torch.stack(losses).mean() if losses else None
        if name == "forward_only":
            assert all(p.grad is None for c in chunks for p in c.parameters())
            if dp_split and loss is not None:
                data_parallel_mean([loss], topo)
            results.append(dict(pp_rank=topo.pp_rank, loss=None if loss is None else loss.item(),
                                grads=None, peak=stats.peak_activations, bound=1,
                                peak_bytes=stats.peak_saved_bytes, per_unit=0))
            continue
        sum_tied_embedding_grads(chunks, topo)
        grads = {n: p.grad for c in chunks for n, p in c.named_parameters()}
        if dp_split:
            data_parallel_mean(list(grads.values()) + ([loss] if loss is not None else []), topo)
        results.append(dict(pp_rank=topo.pp_rank, loss=None if loss is None else loss.item(),
                            # numpy, not tensors: torch would pass tensors back through shared
                            # memory that dies with the worker process
                            grads={n: g.numpy() for n, g in grads.items()},
                            peak=stats.peak_activations,
                            bound=activation_bound(name, pp, topo.pp_rank, m, vpp),
                            peak_bytes=stats.peak_saved_bytes,
                            per_unit=max(stats.saved_bytes.values())))
    return results


def check_against_reference(results_by_rank, cases, ref_loss, ref_grads, rtol=1e-5, atol=1e-5):
    for i, case in enumerate(cases):
        ranks = [r[i] for r in results_by_rank]
        losses = [r["loss"] for r in ranks if r["loss"] is not None]
        assert losses, case
        for loss in losses:
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=str(case))
        if case[0] == "forward_only":
            continue
        seen = set()
        for r in ranks:
            for name, grad in r["grads"].items():
                ref_name = "embedding" if name == "head" else name
                torch.testing.assert_close(torch.from_numpy(grad), ref_grads[ref_name], rtol=rtol,
                                           atol=atol, msg=f"{case}: {name}")
                seen.add(ref_name)
        assert seen == set(ref_grads), (case, set(ref_grads) - seen)


def check_memory(results_by_rank, cases):
    for i, (name, pp, vpp, m, _, _) in enumerate(cases):
        for rank, r in enumerate(results_by_rank):
            res = r[i]
            assert res["peak"] <= res["bound"], (cases[i], rank, res["peak"], res["bound"])
            assert res["peak_bytes"] <= res["bound"] * res["per_unit"], (cases[i], rank)
            if name == "1f1b" and m >= pp:  # the bound is reached: 1F1B holds pp - rank
                assert res["peak"] == pp - res["pp_rank"], (cases[i], rank, res["peak"])


def test_pipeline_matches_single_process_4_ranks():
    ref_loss, ref_grads = reference()
    out = run_distributed(_pipeline_worker, 4, CASES_4)
    check_against_reference(out, CASES_4, ref_loss, ref_grads)
    check_memory(out, CASES_4)
    # GPipe keeps every microbatch alive on every rank; 1F1B only pp - rank of them.
    gpipe, onef = CASES_4.index(("gpipe", 4, 1, 4, False, None)), 0
    assert [r[gpipe]["peak"] for r in out] == [4, 4, 4, 4]
    assert [r[onef]["peak"] for r in out] == [4, 3, 2, 1]
    # Interleaved (pp=4, vpp=2, m=8): warm-up + 1 (microbatch, chunk) units, half a layer stack
    # each: 2(pp-rank-1) + (vpp-1)pp + 1.
    assert [r[1]["peak"] for r in out] == [11, 9, 7, 5]


def test_backward_through_a_deallocated_output():
    """A sent activation's values are dropped; its backward still gives the exact gradients."""
    from megazoo.parallel.pipeline.engine import backward_through, deallocate
    layer = ToyLayer(0)
    x = torch.randn(SEQ, 2, HIDDEN, requires_grad=True)
    grad = torch.randn(SEQ, 2, HIDDEN)
    layer(x).backward(grad)
    expected = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    out = layer(x)
    deallocate(out)
    assert out.numel() == 1  # the storage is gone, the autograd node is not
    backward_through(out, grad)
    for got, want in zip((x.grad, layer.weight.grad, layer.bias.grad), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
