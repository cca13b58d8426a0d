"""The one home of megazoo's raw collectives (everything above them: `parallel/mappings.py`).

Two families, named for what they do:

    blocking, on any tensor            all_reduce(x, g)  all_gather(x, g, dim)  reduce_scatter(x, g, dim)  split(x, g, dim)
                                       all_to_all_rows(x, g, output_splits, input_splits)
                                       all_to_all(x, g, scatter_dim, gather_dim)
                                       broadcast(x, g, src)  barrier(g)
    launched, on flat buffers          all_reduce_async(t, g)  all_gather_into(out, inp, g)  reduce_scatter_into(out, inp, g)
                                       reduce_scatter_consuming(inp, g)  all_gather_in_place(buf, g)
                                       ring_shift(send, recv, g)  (to the next rank of g, from the previous)
                                       exchange(sends, recvs, g)  (batched point-to-point)

The blocking verbs return a tensor; the launched ones return a `Pending` whose `wait()` completes
the operation (and runs an optional follow-up), so buckets can overlap communication with
computation.

Groups mean what they mean to torch: a `ProcessGroup`, or None for the default (world) group.
`SINGLE` is the group of this rank alone, where every collective is the identity without touching
torch.distributed: a `ParallelTopology` hands it out for every group of size 1, and `world()` is
the default group when one is initialised, else `SINGLE`.

NCCL and gloo (torch >= 2.4) both have the fused reduce-scatter and all-gather into one
contiguous tensor, and both have `all_to_all_single` with uneven splits (gloo on CPU tensors),
so there is no fallback path to choose and no backend state to remember. Two verbs for buffers
the caller owns whole (ZeRO's gradient and parameter buckets) take gloo's cheaper route, which
gives the same bytes: `reduce_scatter_consuming` (between two ranks into a given output one
exchange of the halves each needs, else an in-place all-reduce, as gloo's own reduce-scatter does
on a clone) and `all_gather_in_place` (a broadcast per rank).

Inside a compiled region (`--compile`, training/run/compile.py) the blocking verbs all_reduce,
all_gather and reduce_scatter run as torch's functional collectives
(`torch.distributed._functional_collectives`), which torch.compile traces into its graph; the
launched `Work` objects of the eager verbs would each break the graph. The eager path is the same
code as without compilation.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the fused collectives; the old names still work but warn.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


ReduceOp = dist.ReduceOp  # re-exported so callers name reductions without torch.distributed
# The functional collectives' names of the reductions the blocking verbs take while compiled.
_TRACED_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.AVG: "avg"}


class _Single:
    """The group of this rank alone (see the module docstring); compared by identity."""

    def __repr__(self) -> str:
        return "collectives.SINGLE"


SINGLE = _Single()


def world():
    """The default group (None) when torch.distributed is initialised, else `SINGLE`."""
    return None if dist.is_available() and dist.is_initialized() else SINGLE


def is_single(group) -> bool:
    """Whether collectives over `group` are the identity (it is `SINGLE`, or has one rank)."""
    return group_size(group) == 1


class Pending:
    """A launched collective; `wait()` blocks until it is done, then runs `then` once."""

    def __init__(self, work=None, then: Callable[[], None] | None = None):
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def group_size(group) -> int:
    return 1 if group is SINGLE else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is SINGLE else dist.get_rank(group)


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank`."""
    if group is SINGLE:  # its one member is this process
        return group_rank(world())
    return rank if group is None else dist.get_global_rank(group, rank)


def collective_device(group) -> torch.device:
    """The device a tensor must live on for collectives over `group`: the current accelerator
    under NCCL, else the CPU (gloo, and `SINGLE`)."""
    if group is SINGLE or dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _check_divisible(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by group size {n}")


def _traced() -> bool:
    """Whether collectives are being traced by torch.compile: then a blocking verb runs as a
    functional collective, part of the compiled graph."""
    return torch.compiler.is_compiling()


def _functional():
    import torch.distributed._functional_collectives as funcol
    return funcol


def _named(group):
    """`group` as the functional collectives take it (they have no None for the default group)."""
    return dist.group.WORLD if group is None else group


# ---- blocking verbs ------------------------------------------------------------------------

def all_reduce(x: torch.Tensor, group, op=ReduceOp.SUM) -> torch.Tensor:
    """Reduce `x` over the group in place (made contiguous first) and return it."""
    if group_size(group) > 1:
        x = x.contiguous()
        if _traced() and op in _TRACED_OPS:  # a new tensor, as callers use the result
            return _functional().all_reduce(x, _TRACED_OPS[op], _named(group))
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (in group-rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    if _traced():
        return _functional().all_gather_tensor(x.contiguous(), dim, _named(group))
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out.view(-1), x.view(-1), group).wait()  # dim-0 chunks are flat ranges
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's chunk along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n)
    if _traced():
        return _functional().reduce_scatter_tensor(x.contiguous(), "sum", dim, _named(group))
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out.view(-1), x.view(-1), group).wait()
    return out.movedim(0, dim)


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n)
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_to_all_rows(x: torch.Tensor, group, output_splits: list[int],
               input_splits: list[int]) -> torch.Tensor:
    """Rows of `x` in consecutive blocks of `input_splits[r]` go to group rank r; the result holds
    `output_splits[r]` rows from each rank r, in rank order (dim 0, any trailing shape)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of `x` along `scatter_dim` goes to group rank j; the chunks received from every
    rank are concatenated along `gather_dim` (in group-rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, scatter_dim, n)
    inp = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


def broadcast(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Overwrite `x` (contiguous) in place with group rank `src`'s `x` and return it."""
    if group_size(group) > 1:
        dist.broadcast(x, src=global_rank(group, src), group=group)
    return x


def barrier(group) -> None:
    """Return once every rank of the group has reached it."""
    if group_size(group) > 1:
        dist.barrier(group=group)


# ---- launched verbs on flat buffers -----------------------------------------------------------

def all_reduce_async(tensor: torch.Tensor, group, op=ReduceOp.SUM) -> Pending:
    """Launch an in-place all-reduce of a contiguous tensor."""
    if is_single(group):
        return Pending()
    return Pending(dist.all_reduce(tensor, op=op, group=group, async_op=True))


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group) -> Pending:
    """Launch: sum `input` (numel = size * output.numel()) over the group; rank r keeps chunk r."""
    if is_single(group):
        output.copy_(input)
        return Pending()
    return Pending(_REDUCE_SCATTER(output, input, group=group, async_op=True))


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group) -> Pending:
    """Launch: concatenate every rank's `input` into `output` (rank order)."""
    if is_single(group):
        output.copy_(input)
        return Pending()
    return Pending(_ALL_GATHER(output, input, group=group, async_op=True))


def reduce_scatter_consuming(input: torch.Tensor, group,
                             out: torch.Tensor | None = None) -> tuple[Pending, torch.Tensor]:
    """Launch: sum the flat `input` over the group; returns the pending reduction and the tensor
    that holds this rank's chunk once it has landed (`out` where given). The caller gives `input`
    up (its contents are undefined afterwards). Under gloo, whose own reduce-scatter clones the
    input, all-reduces the clone and copies one chunk out: between two ranks and given `out`, one
    exchange (each sends the other's chunk and receives its own into `out`, then adds: half the
    all-reduce's bytes, the same sums bit for bit, since a + b == b + a); otherwise the
    all-reduce in place, the chunk a view of `input` (no buffer to allocate). Elsewhere it is the
    fused reduce-scatter into `out` (or a new tensor)."""
    n = group_size(group)
    if n == 1:
        return Pending(), input
    _check_divisible(input, 0, n)
    if _on_host(group):
        r = group_rank(group)
        chunks = input.view(n, -1)
        if n > 2 or out is None or input.device.type != "cpu":  # (gloo's p2p: host memory)
            return Pending(dist.all_reduce(input, group=group, async_op=True)), chunks[r]
        peer = global_rank(group, 1 - r)
        sent = exchange([(chunks[1 - r], peer)], [(out, peer)], group, tag=_REDUCE_SCATTER_TAG)
        return Pending(sent, lambda: out.add_(chunks[r])), out
    if out is None:
        out = torch.empty(input.numel() // n, dtype=input.dtype, device=input.device)
    return reduce_scatter_into(out, input, group), out


# The point-to-point tag of the two-rank reduce-scatter's messages: apart from other exchanges
# on the same group (a context-parallel ring's run during backward too). Messages with one tag
# between two ranks are matched in the order they were posted, which is the buckets' order.
_REDUCE_SCATTER_TAG = 0x5253


def all_gather_in_place(buffer: torch.Tensor, group) -> Pending:
    """Launch: chunk r of the flat `buffer` holds group rank r's values on rank r; fill in the
    other ranks' chunks. Under gloo, whose fused all-gather gathers into a new flat tensor and
    copies it out, every rank broadcasts its own chunk in place instead (same bytes moved, no
    allocation, no copy). Elsewhere the fused all-gather from a copy of this rank's chunk."""
    n = group_size(group)
    if n == 1:
        return Pending()
    _check_divisible(buffer, 0, n)
    chunks = buffer.view(n, -1).unbind(0)
    if _on_host(group):
        return Pending(_All([dist.broadcast(c, src=global_rank(group, i), group=group,
                                            async_op=True) for i, c in enumerate(chunks)]))
    return all_gather_into(buffer, chunks[group_rank(group)].clone(), group)


def _on_host(group) -> bool:
    """Whether `group`'s collectives run through gloo (host memory, CPU tensors)."""
    return group is not SINGLE and dist.get_backend(group) == "gloo"


def ring_shift(send: torch.Tensor, recv: torch.Tensor, group, tag: int = 0) -> Pending:
    """Launch: send `send` to the next rank of the group's ring and receive `recv` (same shape,
    contiguous) from the previous one, in one `batch_isend_irecv`."""
    n, r = group_size(group), group_rank(group)
    if n == 1:
        recv.copy_(send)
        return Pending()
    nxt, prev = global_rank(group, (r + 1) % n), global_rank(group, (r - 1) % n)
    return exchange([(send, nxt)], [(recv, prev)], group, tag=tag)


def exchange(sends: list, recvs: list, group, tag: int = 0) -> Pending:
    """Launch: send each `(tensor, global peer rank)` of `sends` and receive into each
    `(buffer, global peer rank)` of `recvs`, all in one `batch_isend_irecv` on `group` (every
    peer must be in it; a single batch cannot deadlock on the order of its operations)."""
    if is_single(group):
        raise ValueError("point-to-point exchange on a group of one rank")
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group, tag=tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group, tag=tag) for buf, peer in recvs]
    return Pending(_All(dist.batch_isend_irecv(ops)) if ops else None)


class _All:
    """Several launched works waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
