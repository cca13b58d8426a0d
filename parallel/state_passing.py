"""Context parallelism for linear token mixers (Gated DeltaNet, Mamba-2) whose heads do not split
over the context ranks (those that do run by heads, all ranks at once: parallel/context_heads.py;
models/linear_mixers.py chooses). Each rank holds a contiguous slice of the sequence, in rank
order; a linear layer on rank r starts from the state
rank r - 1 ended with (its recurrent state and its convolution's last inputs) and hands its own
final state to rank r + 1. Backward runs the chain the other way: the gradient of a rank's
initial state is sent back to the rank that produced it.

The ranks of a layer run one after another (rank r waits for r - 1's state), so this divides
activation memory by cp, not the linear layers' time; the state is constant-size (a few MB per
layer at published sizes), so the traffic is one small message per layer and direction.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .collectives import exchange, global_rank, group_rank, group_size


class PassedState(NamedTuple):
    """A state received from another rank (a mixer reads `.conv` and `.recurrent`)."""
    conv: torch.Tensor
    recurrent: torch.Tensor


def _send(tensors, group, to: int) -> None:
    peer = global_rank(group, to)
    exchange([(t.detach().contiguous(), peer) for t in tensors], [], group).wait()


def _recv(shapes, group, frm: int) -> list[torch.Tensor]:
    peer = global_rank(group, frm)
    bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in shapes]
    exchange([], [(b, peer) for b in bufs], group).wait()
    return bufs


class _ReceiveState(torch.autograd.Function):
    """Forward: the state group rank `peer` (default: the previous one) ended with; backward:
    its gradient sent back there. `anchor` (this rank's input) only ties the node into the graph."""

    @staticmethod
    def forward(ctx, anchor, group, shapes, peer=None):
        ctx.group = group
        ctx.peer = group_rank(group) - 1 if peer is None else peer
        return tuple(_recv(shapes, group, ctx.peer))

    @staticmethod
    def backward(ctx, *grads):
        _send(grads, ctx.group, ctx.peer)
        return None, None, None, None


class _SendState(torch.autograd.Function):
    """Forward: y unchanged, this rank's final state sent to group rank `peer` (the next one
    when None); backward: that rank's gradient of the state received and handed to the state's
    producers."""

    @staticmethod
    def forward(ctx, y, group, peer, *states):
        ctx.group = group
        ctx.peer = group_rank(group) + 1 if peer is None else peer
        ctx.shapes = [(s.shape, s.dtype, s.device) for s in states]
        _send(states, group, ctx.peer)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        return (gy, None, None, *_recv(ctx.shapes, ctx.group, ctx.peer))


def state_passing_forward(mixer, x: torch.Tensor, group, resets: torch.Tensor | None = None):
    """mixer(x, state, resets) over a sequence cut into the cp ranks' contiguous slices (x: this
    rank's, [s / cp, b, hidden]; `resets` [b, s / cp]: packed documents' first tokens, where the
    received state is not read); returns (this rank's output, its final state).
    `mixer.state_shapes(b, dtype, device)` gives the state tensors' shapes (conv tail, recurrent)."""
    n, r = group_size(group), group_rank(group)
    state = None
    if r > 0:
        conv, recurrent = _ReceiveState.apply(x, group, mixer.state_shapes(x.shape[1], x.dtype, x.device))
        state = type(mixer).State(conv, recurrent)
    y, final = mixer(x, state, resets)
    if r < n - 1:
        y = _SendState.apply(y, group, None, final.conv, final.recurrent)
    return y, final


def context_state_passing(core, state_shapes, x: torch.Tensor, group, resets=None) -> torch.Tensor:
    """A linear recurrence over megazoo's load-balanced context split (parallel/context_split.py:
    of 2 cp chunks, rank r holds chunks r and 2 cp - 1 - r; x [2c, b, ...] is this rank's two,
    sequence first). The state runs through the chunks in sequence order: up the ranks through
    the first halves (0 -> 1 -> ... -> cp - 1), then down through the second halves
    (cp - 1 -> ... -> 0); the last rank hands its first half's state to its second half locally.
    `core(x, state, resets) -> (y, final state)` (state None: the sequence start; a state has
    `.conv` and `.recurrent`); `state_shapes(b, dtype, device)` gives their shapes; `resets`
    [b, 2c] marks packed documents' first tokens. Returns this rank's outputs [2c, b, ...].

    Backward retraces the chain the other way: the second halves' gradients go up the ranks,
    then the first halves' down. On each rank the second half's graph was built last, so
    autograd (which runs the most recently created ready node first) finishes it, sending its
    state gradient on, before it waits for the first half's."""
    n, r = group_size(group), group_rank(group)
    c = x.shape[0] // 2
    halves = (x[:c], x[c:])
    marks = (None, None) if resets is None else (resets[:, :c], resets[:, c:])
    shapes = state_shapes(x.shape[1], x.dtype, x.device)
    state = None
    if r > 0:
        state = PassedState(*_ReceiveState.apply(halves[0], group, shapes, r - 1))
    ya, final = core(halves[0], state, marks[0])
    if r < n - 1:
        ya = _SendState.apply(ya, group, r + 1, final.conv, final.recurrent)
        state = PassedState(*_ReceiveState.apply(halves[1], group, shapes, r + 1))
    else:
        state = final
    yb, final = core(halves[1], state, marks[1])
    if r > 0:
        yb = _SendState.apply(yb, group, r - 1, final.conv, final.recurrent)
    return torch.cat([ya, yb])
