"""Activation recompute as Megatron-LM configures it: which layers are checkpointed, in what units.

`--recompute-granularity full` checkpoints whole transformer layers: only a unit's input is kept
and the unit's forward runs again inside backward. Which layers, per model chunk (a pipeline stage,
or one virtual stage of it):

- `--recompute-method uniform` (the default): the chunk's layers in consecutive units of
  `--recompute-num-layers` N (default 1), each unit checkpointed as one: fewer kept inputs for
  larger N, the same recompute cost;
- `--recompute-method block`: the first N layers of the chunk are checkpointed one by one, the
  rest keep their activations (recompute only as much as memory requires).

`--recompute-granularity selective` keeps every layer's activations except those of the attention
core, softmax(QK^T)V with its dropout, which is recomputed from q, k and v (the s x s scores are
the largest activation and the cheapest to recompute; models/attention.py). Method and N do not
apply to it.
"""
from __future__ import annotations

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def resolve_recompute(granularity: str | None, method: str | None, num_layers: int | None,
                      total_layers: int) -> tuple[str | None, int | None]:
    """Check the three settings and fill full recompute's defaults: (method, num_layers)."""
    if granularity not in (None,) + GRANULARITIES:
        raise ValueError(f"--recompute-granularity {granularity!r} is not supported; choose one of "
                         f"{GRANULARITIES}")
    if granularity != "full":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num_layers)):
            if value is not None:
                raise ValueError(f"{flag} applies to --recompute-granularity full only (got "
                                 f"{granularity or 'no recompute'}); drop it or pass full")
        return None, None
    method = "uniform" if method is None else method
    num_layers = 1 if num_layers is None else num_layers
    if method not in METHODS:
        raise ValueError(f"--recompute-method {method!r} is not supported; choose one of {METHODS}")
    if not 1 <= num_layers <= total_layers:
        raise ValueError(f"--recompute-num-layers {num_layers} must be between 1 and "
                         f"--num-layers {total_layers}")
    return method, num_layers


def layer_units(config, chunk_layers: int) -> list[tuple[int, int, bool]]:
    """(start, end, checkpointed) over a chunk's `chunk_layers` layers, in order."""
    if config.recompute_granularity != "full":
        return [(i, i + 1, False) for i in range(chunk_layers)]
    n = config.recompute_num_layers
    if config.recompute_method == "block":
        return [(i, i + 1, i < n) for i in range(chunk_layers)]
    return [(i, min(i + n, chunk_layers), True) for i in range(0, chunk_layers, n)]
