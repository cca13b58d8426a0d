"""Flat contiguous buckets: parameters and gradients of several tensors in one padded buffer.

A `FlatBuffer` holds a group of parameters that share a `BucketKey` (same weight decay, same
treatment in the gradient norm, same tied-embedding handling, same reduction group: MoE expert
weights live in buckets of their own, sharded and reduced over the expert-data-parallel group) so that every elementwise rule of
the optimizer applies to the whole buffer at once. The buffer is padded to a multiple of the
data-parallel size and rank r owns the contiguous shard [r * S, (r + 1) * S): reduce-scatter
hands it that shard of the gradient, all-gather spreads the updated parameters back.

Each parameter's `.data` is re-pointed at a view of the flat parameter buffer. Under ZeRO-3 the
full buffer's storage is resized to zero between uses and back before use (FSDP-style): views
taken by autograd in forward keep pointing at the same storage, so backward sees the gathered
values again without any custom autograd function.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import collectives as C
from ..param_spec import spec_of
from .scratch import ScratchPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketKey:
    decay: bool  # weight decay applies
    counted: bool  # counts towards the global gradient norm on this rank
    tied: bool  # tied word embedding: gradients are summed over the embedding group first
    expert: bool = False  # MoE expert weights: reduced and sharded over expert data parallelism
    muon: bool = False  # stepped by Muon (whole matrices), not elementwise (see muon.py)


def param_key(param: torch.nn.Parameter, *, tp_rank: int, is_first_stage: bool,
              decay_biases_and_norms: bool, muon: bool = False) -> BucketKey:
    spec = spec_of(param)
    tp_sharded, tied = spec.tensor_parallel, spec.tied_embedding
    # A replicated parameter holds the same gradient on every TP rank: count it on rank 0 only.
    # The tied embedding's copy on the last stage is the first stage's: count it there only.
    counted = (tp_sharded or tp_rank == 0) and (not tied or is_first_stage)
    decay = param.dim() >= 2 or decay_biases_and_norms
    return BucketKey(decay=decay, counted=counted, tied=tied, expert=spec.expert, muon=muon)


@dataclass
class Slot:
    name: str
    param: torch.nn.Parameter
    offset: int  # element offset inside the bucket
    numel: int
    index: int  # position in the optimizer's global parameter list (for checkpoints)


class FlatBuffer:
    """One bucket. `shard_grads` (ZeRO-2/3) keeps only this rank's gradient shard persistently;
    `shard_params` (ZeRO-3) keeps only this rank's parameter shard persistently."""

    def __init__(self, named: list[tuple[int, str, torch.nn.Parameter]], key: BucketKey, *,
                 dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device, dp_group,
                 dp_rank: int, sharded: bool, shard_grads: bool, shard_params: bool):
        self.key, self.dtype, self.grad_dtype, self.device = key, dtype, grad_dtype, device
        # where transient full gradients come from and go back to (the optimizer sets it)
        self.scratch: ScratchPool | None = None
        self.dp_group = dp_group
        self.dp = C.group_size(dp_group) if sharded else 1
        self.dp_rank = dp_rank if sharded else 0
        self.shard_grads, self.shard_params = shard_grads, shard_params
        self.slots: list[Slot] = []
        offset = 0
        for index, name, p in named:
            self.slots.append(Slot(name, p, offset, p.numel(), index))
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // self.dp) * self.dp  # padding lets every rank own S elements
        self.shard_numel = self.padded // self.dp
        self.shard_start = self.dp_rank * self.shard_numel

        # Copy the weights in at full precision first: that copy seeds the fp32 master shard
        # before the model weights are rounded to the model dtype.
        full = torch.zeros(self.padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for s in self.slots:
                full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        self.initial_master = full[self.shard_slice].clone()
        self.params = full if dtype == torch.float32 else full.to(dtype)
        del full
        self._bind_params()
        self.param_shard: torch.Tensor | None = None
        if shard_params:
            self.param_shard = self.params[self.shard_slice].clone()
            self.release()
        # Gradients: a persistent full buffer (stages 0-1) or a persistent shard plus a transient
        # full bucket that lives from the first gradient until the reduce-scatter has landed.
        self.grads: torch.Tensor | None = None
        self.grad_shard: torch.Tensor
        if shard_grads:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=grad_dtype, device=device)
        else:
            self.grads = torch.zeros(self.padded, dtype=grad_dtype, device=device)
            self.grad_shard = self.grads[self.shard_slice]
        self._transient: torch.Tensor | None = None
        self._transient_buf: torch.Tensor | None = None  # the scratch buffer it is a view of
        # ZeRO-2/3: the shard holds nothing since zero_grad; the first reduction to land is
        # copied in rather than added to zeros (`land`), and `materialize` zeroes it otherwise.
        self._shard_fresh = False
        # Zeroing is lazy: a slot's first gradient after zero_grad (or in a fresh transient
        # bucket) is copied in instead of added to zeros, which saves a pass over every
        # bucket per step; `materialize` zeroes the slots that got none before anyone reads.
        self._unwritten: set[int] = set()  # indices of slots whose region holds no gradient
        self.synced = False  # stage 1: my shard holds a reduced mean since the last zero_grad

    # ---- layout ------------------------------------------------------------------------
    @property
    def shard_slice(self) -> slice:
        return slice(self.shard_start, self.shard_start + self.shard_numel)

    def _bind_params(self) -> None:
        for s in self.slots:
            s.param.data = self.params[s.offset:s.offset + s.numel].view(s.param.shape)

    def shard_ranges(self) -> list[tuple[Slot, int, int]]:
        """(slot, start, end) in bucket coordinates for each parameter overlapping my shard."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        return [(s, max(lo, s.offset), min(hi, s.offset + s.numel)) for s in self.slots
                if s.offset < hi and s.offset + s.numel > lo]

    # ---- gradients -----------------------------------------------------------------------
    def grad_view(self, slot: Slot) -> torch.Tensor:
        if self.grads is not None:
            return self.grads[slot.offset:slot.offset + slot.numel]
        if self._transient is None:
            self._new_transient()[self.numel:].zero_()  # padding
            self._unwritten = {s.index for s in self.slots}
        return self._transient[slot.offset:slot.offset + slot.numel]

    def _new_transient(self) -> torch.Tensor:
        if self.scratch is None:
            self._transient_buf = torch.empty(self.padded, dtype=self.grad_dtype,
                                              device=self.device)
        else:
            self._transient_buf = self.scratch.take(self.padded)
        self._transient = self._transient_buf[:self.padded]
        return self._transient

    def accumulate(self, slot: Slot, grad: torch.Tensor) -> None:
        """Add a parameter's gradient (dense, or row-sparse from an embedding) into the bucket."""
        view = self.grad_view(slot)
        first = slot.index in self._unwritten
        self._unwritten.discard(slot.index)
        if grad.is_sparse:
            if first:
                view.zero_()
            if grad.is_meta:  # shapes only (tools/dry_run.py): no sparse kernels on meta
                return
            grad = grad.coalesce()  # unique rows: the same sums in any order (CUDA atomics)
            rows = grad._values().reshape(-1, *slot.param.shape[1:]).to(view.dtype)
            view.view(slot.param.shape).index_add_(0, grad._indices()[0], rows)
        elif first:
            view.copy_(grad.reshape(-1))
        else:
            view.add_(grad.reshape(-1))

    def accumulate_matmul(self, slot: Slot, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add the gradient a @ b into the bucket without materialising it elsewhere."""
        view = self.grad_view(slot).view(slot.param.shape)
        if slot.index in self._unwritten:
            self._unwritten.discard(slot.index)
            torch.mm(a, b, out=view)
        else:
            view.addmm_(a, b)

    def materialize(self) -> None:
        """Zero the slots that got no gradient since the last zero_grad."""
        full = self.grads if self.grads is not None else self._transient
        if full is not None:
            for s in self.slots:
                if s.index in self._unwritten:
                    full[s.offset:s.offset + s.numel].zero_()
        self._unwritten.clear()

    def take_transient(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand over the transient full gradient bucket (zeros if nothing arrived) and the
        scratch buffer it lives in (for `recycle` once the bucket is no longer read)."""
        if self._transient is None:
            self._new_transient().zero_()
        self.materialize()
        t, buf = self._transient, self._transient_buf
        self._transient = self._transient_buf = None
        return t, buf

    def recycle(self, buf: torch.Tensor) -> None:
        """A transient bucket's buffer is free again (its reduction has landed)."""
        if self.scratch is not None:
            self.scratch.give(buf)

    def claim_shard(self) -> bool:
        """Called as a reduction into the shard is launched: whether the shard holds nothing
        yet (then the reduction may be written straight into it, or copied rather than added)."""
        fresh, self._shard_fresh = self._shard_fresh, False
        return fresh

    def land(self, chunk: torch.Tensor, fresh: bool) -> None:
        """Add this rank's reduced chunk into the persistent gradient shard (`fresh`, from
        `claim_shard`: copy it in; nothing to do when it already is the shard)."""
        if chunk.data_ptr() == self.grad_shard.data_ptr():
            return
        if fresh:
            self.grad_shard.copy_(chunk)
        else:
            self.grad_shard.add_(chunk)

    def materialize_shard(self) -> None:
        """Zero a shard no reduction has landed in since zero_grad (a step without backward)."""
        if self._shard_fresh:
            self.grad_shard.zero_()
            self._shard_fresh = False

    def zero_grad(self) -> None:
        if self.grads is not None:
            self._unwritten = {s.index for s in self.slots}  # padding stays zero throughout
        else:
            self._shard_fresh = True  # zeroed lazily: see claim_shard / materialize_shard
            self._unwritten = set()
        self._transient = self._transient_buf = None
        self.synced = False

    # ---- parameters (ZeRO-3 gather / release) ---------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.params.untyped_storage().nbytes() > 0

    def gather(self, async_op: bool = True) -> C.Pending:
        if self.gathered:
            return C.Pending()
        self.params.untyped_storage().resize_(self.padded * self.params.element_size())
        # Write through .data: the flat buffer's version counter is not the parameters', so
        # refilling it does not trip autograd's saved-tensor checks.
        self.params.data[self.shard_slice].copy_(self.param_shard)
        pending = C.all_gather_in_place(self.params.data, self.dp_group)
        if not async_op:
            pending.wait()
        return pending

    def release(self) -> None:
        self.params.untyped_storage().resize_(0)

    def write_params(self, shard_values: torch.Tensor) -> None:
        """Store this rank's updated shard (any dtype/device) into the model-dtype parameters."""
        target = self.param_shard if self.shard_params else self.params.data[self.shard_slice]
        target.copy_(shard_values)

    def all_gather_params(self) -> C.Pending:
        """Stages 1-2: spread every rank's updated shard into the full parameter buffer."""
        if self.dp == 1 or self.shard_params:
            return C.Pending()
        return C.all_gather_in_place(self.params.data, self.dp_group)

    # ---- accounting ------------------------------------------------------------------------
    def param_bytes(self) -> int:
        live = self.params.untyped_storage().nbytes()
        shard = self.param_shard.nbytes if self.param_shard is not None else 0
        return live + shard

    def grad_bytes(self) -> int:
        full = self.grads.nbytes if self.grads is not None else self.grad_shard.nbytes
        return full + (self._transient.nbytes if self._transient is not None else 0)


def plan_buckets(named: list[tuple[int, str, torch.nn.Parameter]], key_of, bucket_numel: int):
    """Group parameters by key, in order, into buckets of at most `bucket_numel` elements (or
    one parameter, if it alone is larger).

    Parameters arrive in reverse registration order (roughly the order backward produces their
    gradients), so the first bucket fills first and its collective starts earliest.
    """
    open_: dict[BucketKey, tuple[list, int]] = {}
    done: list[tuple[BucketKey, list]] = []
    for item in named:
        key, n = key_of(item[2]), item[2].numel()
        bucket, size = open_.get(key, ([], 0))
        if bucket and size + n > bucket_numel:
            done.append((key, bucket))
            bucket, size = [], 0
        bucket.append(item)
        open_[key] = (bucket, size + n)
    done.extend((key, bucket) for key, (bucket, _) in open_.items())
    return done
