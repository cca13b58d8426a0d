"""Named RNG streams and activation checkpointing that replays them exactly.

Dropout must be *different* across TP ranks where each rank holds different data (attention
heads, sequence chunks under sequence parallelism) and *identical* where activations are
replicated. We keep the device's default generator for replicated regions and swap in a named
stream ("tensor-parallel", seeded per TP rank) for sharded ones, like Megatron's RNG tracker,
but as an explicit object owned by the caller rather than a module global.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

TP_STREAM = "tensor-parallel"


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device).set_rng_state(state, device)


def _seed_device(device: torch.device, seed: int) -> None:
    """Seed this device's default generator only (torch.manual_seed would seed every device)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.get_device_module(device).manual_seed(seed)


class RNGStreams:
    """Named generator states swapped into the device's default generator on demand."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_device_state(self.device)
        _seed_device(self.device, seed)
        self.states[name] = _get_device_state(self.device)
        _set_device_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        """Run the body on stream `name`; the default generator is untouched by it."""
        if name not in self.states:  # a misspelt or unregistered stream would share the default
            raise ValueError(f"no RNG stream {name!r}; known streams: {sorted(self.states) or 'none'} "
                           f"(register it with RNGStreams.add)")
        saved = _get_device_state(self.device)
        _set_device_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_state(self.device)
            _set_device_state(self.device, saved)

    # Snapshot of every stream plus the default generator (for recompute and checkpoints).
    def get_states(self) -> dict[str, torch.Tensor]:
        return {"default": _get_device_state(self.device), **{k: v.clone() for k, v in self.states.items()}}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        _set_device_state(self.device, states["default"])
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}


def model_parallel_seed(seed: int, topo) -> RNGStreams:
    """Seed torch's generators for this rank and return its streams.

    Default generator: seed + 100 * pp_rank (identical across TP and DP ranks of a stage); the CPU
    generator gets it too when the model runs on an accelerator. Tensor-parallel stream: seed + 2718 +
    tp_rank (different on every TP rank). Python's and NumPy's global generators are left alone:
    megazoo draws nothing from them (datasets and mock data use their own seeded generators).
    """
    default_seed = seed + 100 * topo.pp_rank
    torch.default_generator.manual_seed(default_seed)
    _seed_device(topo.device, default_seed)
    streams = RNGStreams(topo.device)
    streams.add(TP_STREAM, seed + 2718 + topo.tp_rank)
    return streams


def checkpoint(fn, rng: RNGStreams | None, *args):
    """Activation checkpointing: keep only the inputs, recompute `fn` in backward.

    The RNG streams are captured when the forward runs and restored around the recompute, so
    dropout masks (default and tensor-parallel) are identical in both passes; the streams then
    continue from where the forward left them.
    """
    if rng is None or torch.compiler.is_compiling():
        # compiled (--compile, selective recompute inside a layer): torch.compile traces the
        # checkpoint itself and cannot trace a context_fn; with dropout, its recompute draws from
        # torch's own RNG state handling, not from these streams
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    snapshot: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def capture():
        snapshot.update(rng.get_states())
        yield

    @contextlib.contextmanager
    def replay():
        current = rng.get_states()
        rng.set_states(snapshot)
        try:
            yield
        finally:
            rng.set_states(current)

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                                             context_fn=lambda: (capture(), replay()))
