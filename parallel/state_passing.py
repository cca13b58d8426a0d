"""Context parallelism for linear token mixers (Gated DeltaNet, Mamba-2): each rank holds a
contiguous slice of the sequence, in rank order; a linear layer on rank r starts from the state
rank r - 1 ended with (its recurrent state and its convolution's last inputs) and hands its own
final state to rank r + 1. Backward runs the chain the other way: the gradient of a rank's
initial state is sent back to the rank that produced it.

The ranks of a layer run one after another (rank r waits for r - 1's state), so this divides
activation memory by cp, not the linear layers' time; the state is constant-size (a few MB per
layer at published sizes), so the traffic is one small message per layer and direction.
"""
from __future__ import annotations

import torch

from .collectives import exchange, global_rank, group_rank, group_size


def _send(tensors, group, to: int) -> None:
    peer = global_rank(group, to)
    exchange([(t.detach().contiguous(), peer) for t in tensors], [], group).wait()


def _recv(shapes, group, frm: int) -> list[torch.Tensor]:
    peer = global_rank(group, frm)
    bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in shapes]
    exchange([], [(b, peer) for b in bufs], group).wait()
    return bufs


class _ReceiveState(torch.autograd.Function):
    """Forward: the previous rank's final state; backward: its gradient sent back there.
    `anchor` (this rank's input) only ties the node into the graph."""

    @staticmethod
    def forward(ctx, anchor, group, shapes):
        ctx.group, ctx.rank = group, group_rank(group)
        return tuple(_recv(shapes, group, ctx.rank - 1))

    @staticmethod
    def backward(ctx, *grads):
        _send(grads, ctx.group, ctx.rank - 1)
        return None, None, None


class _SendState(torch.autograd.Function):
    """Forward: y unchanged, this rank's final state sent to the next rank; backward: the next
    rank's gradient of that state received and handed to the state's producers."""

    @staticmethod
    def forward(ctx, y, group, *states):
        ctx.group, ctx.rank = group, group_rank(group)
        ctx.shapes = [(s.shape, s.dtype, s.device) for s in states]
        _send(states, group, ctx.rank + 1)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        return (gy, None, *_recv(ctx.shapes, ctx.group, ctx.rank + 1))


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
        y = _SendState.apply(y, group, final.conv, final.recurrent)
    return y, final
