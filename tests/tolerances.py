"""How the tests compare parameters after optimizer steps: one rule, used by every such test.

Losses, gradients and gradient norms are compared at fp32 rounding (rtol = atol = 1e-5): they are
sums whose order differs between layouts and between BLAS kernels, and their error stays near the
rounding unit. Parameters after Adam steps are not: Adam divides each gradient element by its own
running magnitude, so where a gradient is small against its rounding error (a bias whose true
gradient is nearly zero, an element whose gradients cancel over the steps) rounding noise becomes
a step of up to +-lr. On another CPU (other kernels, other rounding) a per-element atol of 1e-5
then fails for one element in thousands although the parallel code is right.

So parameters are compared by how far they are from the reference *relative to how far training
moved them*: for every tensor t,

    ||got_t - want_t|| <= rel * max(||want_t - init_t||, lr * sqrt(numel_t))

with `rel` = 1e-3 by default. The floor lr * sqrt(numel) is one Adam step of every element: a
tensor that training barely moved (a gradient that is mathematically zero) is judged against the
smallest move Adam makes, not against its own noise. Rounding moves a tensor by far less than
1e-3 of its update (measured on the ZeRO parity tests, 3 AdamW steps at lr 1e-2, tp = 2 dp = 2:
at most 8.5e-6 with the default kernels, 1.1e-5 with ATEN_CPU_CAPABILITY=avx2); a parallel bug
changes the update itself (skipping the data-parallel all-reduce of one gradient bucket: 0.82 on
layers.1.mlp.fc2.weight).
Exact results (resume from a checkpoint, skipped steps, offload vs in-memory) are compared with
`assert_params_equal`, bit for bit.
"""
from __future__ import annotations

import math

import torch

TRAINED_REL = 1e-3


def update_deviation(got: dict, want: dict, init: dict, names=None) -> float:
    """||got - want|| / ||want - init|| over `names` (default: all of got) taken together."""
    names = list(got) if names is None else list(names)
    num = sum((got[n].double() - want[n].double()).square().sum() for n in names)
    den = sum((want[n].double() - init[n].double()).square().sum() for n in names)
    return math.sqrt(num / den)


def trained_deviations(got: dict, want: dict, init: dict, lr: float) -> dict[str, float]:
    """Per tensor: ||got - want|| / max(||want - init||, lr * sqrt(numel))."""
    out = {}
    for name, t in got.items():
        moved = (want[name].double() - init[name].double()).norm().item()
        floor = lr * math.sqrt(t.numel())
        out[name] = (t.double() - want[name].double()).norm().item() / max(moved, floor)
    return out


def assert_trained_close(got: dict, want: dict, init: dict, where: str, lr: float,
                         rel: float = TRAINED_REL) -> float:
    """Parameters after optimizer steps, by the rule above; returns the largest deviation."""
    assert got and set(got) <= set(want) and set(got) <= set(init), (where, set(got) - set(want))
    for name, t in got.items():
        assert t.shape == want[name].shape, (where, name, t.shape, want[name].shape)
    dev = trained_deviations(got, want, init, lr)
    worst = max(dev, key=dev.get)
    assert dev[worst] <= rel, f"{where} {worst}: deviation {dev[worst]:.2e} of the update > {rel:.0e}"
    return dev[worst]


def assert_params_equal(got: dict, want: dict, where: str) -> None:
    """Bit-for-bit equality, for results that are exact (resume, skipped steps, offload)."""
    assert got and set(got) <= set(want), (where, set(got) - set(want))
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0,
                                   msg=lambda m: f"{where} {name}: {m}")


def assert_curves_close(got, want, where, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Two loss curves: the same non-zero length, then |got - want| <= atol + rtol |want| per step
    (a bare zip would pass on an empty or truncated curve)."""
    got, want = list(got), list(want)
    assert want and len(got) == len(want), (where, len(got), len(want), got, want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= atol + rtol * abs(b), (where, step, got, want)
