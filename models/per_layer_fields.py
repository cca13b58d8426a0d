"""The config rules of per-layer inputs (Gemma 4's hidden_size_per_layer_input; the module is
models/per_layer_inputs.py): sizes in range, and the layouts and recompute they cannot take, each
refusal one line naming the field."""
from __future__ import annotations


def check_per_layer_inputs(config) -> None:
    size, vocab = config.per_layer_input_size, config.per_layer_input_vocab_size
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"per_layer_input_size must be an integer >= 0, got {size}")
    if vocab is not None and (not size or not isinstance(vocab, int) or vocab < 1):
        raise ValueError(f"per_layer_input_vocab_size {vocab} needs per_layer_input_size > 0 and "
                         f"an integer >= 1 (None: vocab_size)")
    if size and config.recompute_granularity == "full":
        raise ValueError("per_layer_input_size with --recompute-granularity full is not modelled "
                         "(a recomputed layer's per-layer input would get no gradient); use "
                         "selective recompute or none")


def per_layer_inputs_layout(config, parallel) -> str | None:
    """Why `parallel` cannot run these per-layer inputs (one line), or None: the first stage
    computes them for every layer."""
    if config.per_layer_input_size and parallel.pp > 1:
        return (f"per_layer_input_size {config.per_layer_input_size} needs "
                f"--pipeline-model-parallel-size 1 (the first stage computes every layer's "
                f"per-layer input), got {parallel.pp}")
    return None
