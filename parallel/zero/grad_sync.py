"""Bucketed gradient synchronisation over data parallelism, overlapped with backward.

Each parameter gets a post-accumulate-grad hook that adds its fresh gradient into its bucket's
flat gradient buffer (fp32 by default, so micro-batches accumulate in fp32 even for bf16/fp16
weights) and drops `param.grad`. Embedding gradients may arrive row-sparse, and matrices whose
dtype matches the buffer get a `ParamSpec.accumulate_wgrad` (`set_spec`), through which linear
layers write their weight gradient into the bucket themselves (see grad_fusion.py); the hook
still marks them ready. When the last parameter of a bucket has reported in the
micro-batch that synchronises, the bucket's collective is launched asynchronously while
backward carries on with earlier layers:

    stage 0      all-reduce the full bucket (every rank keeps the full mean gradient)
    stage 1      reduce-scatter; the full buffer persists for accumulation, only my shard is valid
    stage 2, 3   reduce-scatter every micro-batch into a persistent shard; the full bucket is
                 transient and at most `max_inflight` of them are in flight at once; their
                 buffers come from (and return to) a `ScratchPool` shared by the buckets, so
                 they are not allocated afresh every step

Reductions use `collectives.reduce_scatter_consuming` (gloo: between two ranks, for a shard's
first reduction after zero_grad, one exchange of half buckets straight into the shard; else an
in-place all-reduce; the same sums gloo's own reduce-scatter computes on a clone). A ZeRO-2/3
shard is zeroed lazily: that first reduction lands in it (by copy where it was all-reduced).

Gradients are divided by the DP size (a mean, as in DDP): before the collective at stages 0-1
and for fp16, after it (this rank's chunk only) at stages 2-3. Each bucket is reduced over its
own group (`FlatBuffer.dp_group`): data parallelism, or for MoE expert weights the
expert-data-parallel ranks; experts still divide by the full DP size, because an expert's
gradient already sums the tokens of its whole expert-parallel group. The tied word
embedding's bucket is first summed over the embedding group (first + last pipeline stage).
Collectives are launched in the order backward completes buckets, which is the same on every
DP rank because they run the same graph; `finish()` launches the rest in a fixed order.
"""
from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Callable

import torch
from torch.autograd import Variable

from .. import collectives as C
from ..param_spec import set_spec
from .flat_buffer import FlatBuffer

logger = logging.getLogger(__name__)


class GradSync:
    def __init__(self, buffers: list[FlatBuffer], *, stage: int, dp_group, embedding_group,
                 max_inflight: int = 2):
        self.buffers, self.stage = buffers, stage
        self.dp_group, self.embedding_group = dp_group, embedding_group
        self.dp = C.group_size(dp_group)
        self.max_inflight = max_inflight
        self._sync = True
        self._end_queued = False
        self._unsynced = False  # gradients accumulated under no_sync, not yet reduced
        self._deferred: list[int] = []  # tied-embedding buckets, reduced at finish()
        self._finishing = False
        self._where = {id(s.param): (b, s) for b in buffers for s in b.slots}
        self._seen: dict[int, set[int]] = {}  # bucket idx -> slot indices seen this micro-batch
        self._grad_nodes: dict[int, object] = {}  # id(param) -> its AccumulateGrad node
        self._launched: set[int] = set()
        self._inflight: dict[int, C.Pending] = {}  # bucket idx -> reduction in flight
        self._handles = []
        self.on_launched: list[Callable[[FlatBuffer], None]] = []  # ZeRO-3 releases params here
        self._index = {id(b): i for i, b in enumerate(buffers)}

    # ---- hooks ---------------------------------------------------------------------------
    def install_hooks(self) -> None:
        with torch.enable_grad():
            for b in self.buffers:
                for s in b.slots:
                    self._handles.append(s.param.register_post_accumulate_grad_hook(self._hook))
                    set_spec(s.param, accepts_sparse_grad=True)  # FlatBuffer.accumulate adds rows
                    if s.param.dim() == 2 and s.param.dtype == b.grad_dtype:  # grad_fusion.py
                        set_spec(s.param, accumulate_wgrad=functools.partial(
                            self._accumulate_wgrad, s.param))
                        # the weight's gradient-accumulation node (autograd keeps one per
                        # leaf while it is referenced): tells whether a backward computes it
                        self._grad_nodes[id(s.param)] = \
                            s.param.view_as(s.param).grad_fn.next_functions[0][0]

    def _accumulate_wgrad(self, param: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor) -> torch.Tensor | None:
        """Called from a layer's backward with its weight gradient as a product a @ b, computed
        straight into the bucket. Returns what the layer hands autograd for the weight: an
        empty row-sparse gradient (an exact zero), so that the hook still runs once every
        gradient of the weight is in and adds any other one (a tied embedding's rows, another
        use of the weight) as usual. None, with nothing written, when this backward does not
        compute the weight's gradient (torch.autograd.grad for other inputs)."""
        node = self._grad_nodes.get(id(param))
        if node is not None and not _will_execute(node):
            return None
        bucket, slot = self._where[id(param)]
        self._wait(self._index[id(bucket)])
        with torch.no_grad():
            bucket.accumulate_matmul(slot, a, b)
        return _zero_rows(param)

    def _hook(self, param: torch.Tensor) -> None:
        bucket, slot = self._where[id(param)]
        if param.grad is None:
            return
        i = self._index[id(bucket)]
        self._wait(i)  # an earlier micro-batch's reduction may still be using this buffer
        with torch.no_grad():
            bucket.accumulate(slot, param.grad)
        param.grad = None  # the bucket owns the gradient now; free the per-tensor copy
        if not self.sync_enabled:
            self._unsynced = True
            return
        if not self._end_queued:
            # Like DDP: run once when this backward pass ends, to launch the buckets whose
            # parameters got no gradient and to start the next micro-batch afresh.
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        seen = self._seen.setdefault(i, set())
        seen.add(slot.index)
        if len(seen) == len(bucket.slots) and i not in self._launched:
            self._launch(i)

    # ---- micro-batch control ---------------------------------------------------------------
    @property
    def sync_enabled(self) -> bool:
        # Sharded gradients cannot be accumulated unreduced: ZeRO-2/3 reduce every micro-batch.
        return self._sync or self.stage >= 2

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (stages 0-1) without communicating, like DDP.no_sync."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ---- collectives -----------------------------------------------------------------------
    def _launch(self, i: int) -> None:
        b = self.buffers[i]
        self._launched.add(i)
        self._wait(i)
        tied = b.key.tied and not C.is_single(self.embedding_group)
        if tied and not self._finishing:
            # The embedding group spans the first and last pipeline stage, which are at
            # different points of the schedule during backward: a collective between them
            # here would deadlock against the pipeline's p2p. Reduce it in finish() instead
            # (its gradient keeps accumulating in the bucket until then).
            self._deferred.append(i)
            return
        b.materialize()
        full, buf = (b.grads, None) if b.grads is not None else b.take_transient()
        if tied:
            C.all_reduce(full, self.embedding_group)
        # Stages 2-3 divide by dp after the reduction, this rank's chunk only (1/dp of the pass;
        # for dp a power of two the same bits). fp16 divides first: a sum over ranks may
        # overflow where the mean does not.
        later = self.dp if self.stage >= 2 and b.grad_dtype != torch.float16 else 1
        if self.dp > 1 and later == 1:
            full.div_(self.dp)
        if self.stage == 0:
            self._inflight[i] = C.all_reduce_async(full, b.dp_group)
        elif self.stage == 1:  # the full buffer is zeroed outside the shard once it lands
            pending, chunk = C.reduce_scatter_consuming(full, b.dp_group)
            self._inflight[i] = C.Pending(pending, functools.partial(_land_stage1, b, chunk,
                                                                     self.dp))
        else:  # the transient bucket goes back to the pool once the reduction has landed
            fresh = b.claim_shard()
            pending, chunk = C.reduce_scatter_consuming(
                full, b.dp_group, out=b.grad_shard if fresh else None)
            self._inflight[i] = C.Pending(pending, functools.partial(_land_sharded, b, chunk,
                                                                     fresh, buf, later))
            while self.stage >= 2 and len(self._inflight) > self.max_inflight:
                self._wait(next(iter(self._inflight)))
        for fn in self.on_launched:
            fn(b)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._unsynced = False  # every bucket is launched below, carrying earlier micro-batches
        for i in range(len(self.buffers)):
            if i not in self._launched:
                self._launch(i)
        self._launched.clear()
        self._seen.clear()

    def launch_remaining(self) -> None:
        """Start reducing gradients accumulated under `no_sync` now (e.g. right after a
        pipeline schedule), so the reductions overlap whatever runs before `step()`."""
        if self._unsynced:
            self._end_of_backward()

    def finish(self) -> None:
        """Wait until every reduction has landed in the gradient buffers.

        Gradients accumulated entirely under `no_sync` (e.g. a pipeline schedule run inside it)
        are reduced here, without overlap.
        """
        self.launch_remaining()
        self._finishing = True
        try:
            for i in sorted(set(self._deferred)):
                self._launch(i)
        finally:
            self._finishing = False
        self._deferred.clear()
        self._launched.clear()
        for i in list(self._inflight):
            self._wait(i)
        for b in self.buffers:
            b.materialize()  # a step without any backward still reads zeros
            b.materialize_shard()
            if b.synced:  # stage 1: shards were left at dp x the mean (see _land_stage1)
                b.grad_shard.div_(self.dp)
                b.synced = False

    def _wait(self, i: int) -> None:
        pending = self._inflight.pop(i, None)
        if pending is not None:
            pending.wait()


def _will_execute(node) -> bool:
    check = getattr(torch._C, "_will_engine_execute_node", None)  # what FSDP asks, torch >= 2.0
    return True if check is None else check(node)


def _zero_rows(param: torch.Tensor) -> torch.Tensor:
    """An empty row-sparse tensor shaped like `param`: a gradient of exactly zero, for free."""
    rows = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty((0,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(rows, values, param.shape, is_coalesced=True,
                                   check_invariants=False)


def _land_sharded(b: FlatBuffer, chunk: torch.Tensor, fresh: bool, buf, dp: int) -> None:
    if dp > 1:
        chunk.div_(dp)
    b.land(chunk, fresh)
    b.recycle(buf)


def _land_stage1(b: FlatBuffer, chunk: torch.Tensor, dp: int) -> None:
    # Stage 1 keeps one full gradient buffer across micro-batches. Outside my shard it holds
    # local gradients that are now reduced into other ranks' shards: zero them so a later
    # reduction does not count them twice. My shard keeps dp x the mean, so that if another
    # micro-batch adds its local gradient and reduces again (dividing by dp first), the earlier
    # mean survives intact; finish() divides by dp once at the end. (`chunk` may be the shard
    # itself: reduced in place.)
    b.grads[:b.shard_start].zero_()
    b.grads[b.shard_start + b.shard_numel:].zero_()
    if chunk.data_ptr() != b.grad_shard.data_ptr():
        b.grad_shard.copy_(chunk)
    b.grad_shard.mul_(dp)
    b.synced = True
