"""Pipeline schedules as data: for each rank, the list of steps it executes, in order.

A schedule is built in two passes, both pure functions (testable without processes):

1. the *compute order*: which `Forward(mb, chunk)` / `Backward(mb, chunk)` a rank runs when.
   This is where no-pipelining, GPipe, 1F1B and interleaved 1F1B differ;
2. `with_communication` wraps every compute step in the p2p it needs: receive its input before a
   forward (unless it is the model's first block), send its output after it (unless last), and
   the mirror image for the gradients of a backward.

Peers are *pipeline* ranks (0..pp-1); the engine maps them to global ranks. The engine posts each
run of consecutive communication steps as one batch (`comm_batches` gives the exact grouping), so
in the 1F1B steady state "send my activation, receive the gradient I need next" travel together,
as in Megatron's send_forward_recv_backward. `parallel.pipeline.simulate` checks that this
grouping always matches between peers and cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazoo.parallel.topology import LayoutError


# ---- the instruction set ------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    mb: int  # microbatch index
    chunk: int  # this rank's virtual chunk (0..vpp-1)


class Compute(Step):
    """A step that runs the model."""


@dataclass(frozen=True)
class Comm(Step):
    """A point-to-point step with the neighbouring stage `peer` (a pipeline rank)."""

    peer: int = -1


# Subclasses add no fields: the dataclass __eq__/__repr__ they inherit compare and print the class.
class Forward(Compute):
    pass


class Backward(Compute):
    pass


class SendActivation(Comm):
    pass


class RecvActivation(Comm):
    pass


class SendGrad(Comm):
    pass


class RecvGrad(Comm):
    pass


SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)


# ---- compute orders -----------------------------------------------------------------------

def _check(pp: int, rank: int, num_microbatches: int, vpp: int = 1) -> None:
    if pp < 1 or vpp < 1:
        raise LayoutError(f"pipeline sizes must be >= 1, got pp={pp} vpp={vpp}")
    if not 0 <= rank < pp:
        raise LayoutError(f"pipeline rank {rank} out of range for pp={pp}")
    if num_microbatches < 1:
        raise LayoutError(f"need at least one microbatch, got {num_microbatches}")


def order_no_pipelining(pp: int, rank: int, num_microbatches: int) -> list[Compute]:
    """Gradient accumulation: each microbatch goes all the way forward and back before the next.

    With pp > 1 only one stage works at a time (naive model parallelism); one activation is held.
    """
    _check(pp, rank, num_microbatches)
    return [s for mb in range(num_microbatches) for s in (Forward(mb, 0), Backward(mb, 0))]


def order_gpipe(pp: int, rank: int, num_microbatches: int) -> list[Compute]:
    """All forwards, then all backwards (GPipe): holds every microbatch's activations."""
    _check(pp, rank, num_microbatches)
    return ([Forward(mb, 0) for mb in range(num_microbatches)]
            + [Backward(mb, 0) for mb in range(num_microbatches)])


def order_1f1b(pp: int, rank: int, num_microbatches: int) -> list[Compute]:
    """PipeDream-flush / Megatron 1F1B: warm up with pp-rank-1 forwards, then alternate.

    A backward starts as soon as its gradient can arrive, so at most pp - rank microbatches are
    alive on this rank, whatever the number of microbatches.
    """
    _check(pp, rank, num_microbatches)
    warmup = min(pp - rank - 1, num_microbatches)
    order: list[Compute] = [Forward(mb, 0) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Forward(warmup + i, 0), Backward(i, 0)]
    order += [Backward(mb, 0) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_warmup(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    """Forwards a rank runs before its first backward, in (microbatch, chunk) units.

    Every rank first fills its later chunks for one group of pp microbatches ((vpp-1)*pp), and
    earlier ranks run two more per stage of distance to the end: one for the forward still
    travelling down, one for the backward travelling back up.
    """
    total = num_microbatches * vpp
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def _interleaved_unit(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of a rank's k-th forward (or backward) in the interleaved schedule.

    Microbatches go in groups of pp: chunk 0 runs the group, then chunk 1 runs the same group, ...
    then the next group. Backwards walk the chunks in reverse.
    """
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return group * pp + k % pp, chunk


def order_interleaved(pp: int, vpp: int, rank: int,
                      num_microbatches: int) -> list[list[Compute]]:
    """Megatron's interleaved 1F1B over vpp virtual chunks per rank.

    Cuts the bubble by vpp at the price of vpp times more p2p messages. Microbatches are grouped
    by pp, so the microbatch count must be a multiple of pp. Returns *slots* (see
    `with_communication`): single forwards (warm-up), (forward, backward) pairs (steady state),
    single backwards (cool-down).
    """
    _check(pp, rank, num_microbatches, vpp)
    if vpp > 1 and pp == 1:
        raise LayoutError("interleaved schedule needs pp > 1 (virtual chunks on one rank are "
                          "just more layers); use 1F1B or set vpp=1")
    if num_microbatches % pp != 0:
        raise LayoutError(f"interleaved schedule needs the number of microbatches "
                          f"({num_microbatches}) to be a multiple of pp ({pp})")
    total = num_microbatches * vpp
    warmup = interleaved_warmup(pp, vpp, rank, num_microbatches)
    fwd = [Forward(*_interleaved_unit(k, pp, vpp, True)) for k in range(total)]
    bwd = [Backward(*_interleaved_unit(k, pp, vpp, False)) for k in range(total)]
    steady = total - warmup
    return ([[f] for f in fwd[:warmup]]
            + [[fwd[warmup + k], bwd[k]] for k in range(steady)]
            + [[b] for b in bwd[steady:]])


def order_forward_only(pp: int, vpp: int, rank: int, num_microbatches: int) -> list[Compute]:
    """Evaluation: forwards only, in the interleaved order (plain order when vpp == 1)."""
    _check(pp, rank, num_microbatches, vpp)
    if vpp == 1:
        return [Forward(mb, 0) for mb in range(num_microbatches)]
    if num_microbatches % pp != 0:
        raise LayoutError(f"forward-only with virtual stages needs the number of microbatches "
                          f"({num_microbatches}) to be a multiple of pp ({pp})")
    return [Forward(*_interleaved_unit(k, pp, vpp, True)) for k in range(num_microbatches * vpp)]


# ---- communication ------------------------------------------------------------------------

def _recvs_for(op: Compute, pp: int, vpp: int, rank: int) -> list[Comm]:
    stage, last = op.chunk * pp + rank, pp * vpp - 1
    if isinstance(op, Forward):
        return [RecvActivation(op.mb, op.chunk, peer=(rank - 1) % pp)] if stage > 0 else []
    return [RecvGrad(op.mb, op.chunk, peer=(rank + 1) % pp)] if stage < last else []


def _sends_for(op: Compute, pp: int, vpp: int, rank: int) -> list[Comm]:
    stage, last = op.chunk * pp + rank, pp * vpp - 1
    if isinstance(op, Forward):
        return [SendActivation(op.mb, op.chunk, peer=(rank + 1) % pp)] if stage < last else []
    return [SendGrad(op.mb, op.chunk, peer=(rank - 1) % pp)] if stage > 0 else []


def _batch_order(op: Comm) -> tuple:
    # Messages between one pair of ranks match in posting order, so both ends must post them in
    # the same order: activations before gradients, then by microbatch and chunk.
    return (isinstance(op, (SendGrad, RecvGrad)), op.mb, op.chunk)


def with_communication(slots: list[list[Compute]], pp: int, vpp: int, rank: int) -> list[Step]:
    """Insert p2p between *slots* of compute steps.

    Between two slots one batch carries the sends owed by the slot just run and the receives the
    next slot needs. A slot is one step, except in the interleaved steady state, where it is a
    (forward, backward) pair: there the gradient for the pair's backward must be asked for before
    the pair starts (as Megatron does), else ranks wait on each other's sends in a cycle.
    """
    steps: list[Step] = []
    owed: list[Comm] = []
    for slot in slots:
        batch = owed + [r for op in slot for r in _recvs_for(op, pp, vpp, rank)]
        steps += sorted(batch, key=_batch_order)
        steps += slot
        owed = [s for op in slot for s in _sends_for(op, pp, vpp, rank)]
    steps += sorted(owed, key=_batch_order)
    return steps


def comm_batches(steps: list[Step]) -> list[Compute | list[Comm]]:
    """Group runs of consecutive Comm steps: each group is posted as one batch_isend_irecv."""
    out: list[Compute | list[Comm]] = []
    for step in steps:
        if isinstance(step, Comm):
            if out and isinstance(out[-1], list):
                out[-1].append(step)
            else:
                out.append([step])
        else:
            out.append(step)
    return out


# ---- public entry points --------------------------------------------------------------------

SCHEDULES = ("no_pipelining", "gpipe", "1f1b", "interleaved", "forward_only")


def build_schedule(name: str, pp: int, rank: int, num_microbatches: int,
                   vpp: int = 1) -> list[Step]:
    """The full step list (compute + p2p) for one pipeline rank."""
    if name == "interleaved":
        order = order_interleaved(pp, vpp, rank, num_microbatches)
    elif name == "forward_only":
        order = order_forward_only(pp, vpp, rank, num_microbatches)
    elif vpp != 1:
        raise LayoutError(f"schedule {name!r} runs one chunk per rank; use 'interleaved' for "
                          f"vpp={vpp}")
    elif name == "no_pipelining":
        order = order_no_pipelining(pp, rank, num_microbatches)
    elif name == "gpipe":
        order = order_gpipe(pp, rank, num_microbatches)
    elif name == "1f1b":
        order = order_1f1b(pp, rank, num_microbatches)
    else:
        raise LayoutError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
    if name != "interleaved":
        order = [[op] for op in order]  # one compute step per slot
    return with_communication(order, pp, vpp, rank)


def activation_bound(name: str, pp: int, rank: int, num_microbatches: int, vpp: int = 1) -> int:
    """Most (microbatch, chunk) activations the schedule keeps alive at once on `rank`."""
    if name == "no_pipelining":
        return 1
    if name == "forward_only":
        return 1  # no graph is kept; one output at most waits for its send
    if name == "gpipe":
        return num_microbatches
    if name == "1f1b":
        return min(pp - rank, num_microbatches)
    if name == "interleaved":
        # The warm-up forwards plus the one forward of the first steady-state pair.
        return min(interleaved_warmup(pp, vpp, rank, num_microbatches) + 1,
                   num_microbatches * vpp)
    raise LayoutError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")
