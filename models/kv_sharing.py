"""KV sharing (Gemma 4's num_kv_shared_layers): the last `kv_shared_layers` layers project no keys
or values; each attends with those of the last earlier layer of its kind (sliding or full), as
that layer attended with them (after its norms, RoPE and KV cache). The config's rules and the
producer of each sharing layer; the attention takes them from `MixerSpec.kv_source`."""
from __future__ import annotations


def kv_source(config, layer: int) -> int | None:
    """The layer whose keys and values `layer` attends with (one of the last `kv_shared_layers`:
    the last layer of its kind before them), else None."""
    first = config.num_layers - config.kv_shared_layers
    if not config.kv_shared_layers or not first <= layer < config.num_layers:
        return None
    window = config.attention_window(layer)
    return next((i for i in range(first - 1, -1, -1) if config.attention_window(i) == window),
                None)


def check_kv_sharing(config) -> None:
    """kv_shared_layers in range with a producer for every sharing layer, and the wide MLP
    (kv_shared_double_mlp) only with it; each refusal one line naming the field."""
    n = config.kv_shared_layers
    if not isinstance(n, int) or not 0 <= n < config.num_layers:
        raise ValueError(f"kv_shared_layers must be an integer in 0..{config.num_layers - 1} (the "
                         f"last layers reuse earlier ones' keys and values), got {n}")
    if config.kv_shared_double_mlp and not n:
        raise ValueError("kv_shared_double_mlp widens the KV-sharing layers' MLPs: set "
                         "kv_shared_layers or drop it")
    if n and config.recompute_granularity == "full":
        raise ValueError("kv_shared_layers with --recompute-granularity full is not modelled (a "
                         "recomputed layer's keys and values would not carry their gradient to "
                         "the layers reusing them); use selective recompute or none")
    for layer in range(config.num_layers - n, config.num_layers):
        if kv_source(config, layer) is None:
            kind = "sliding" if config.attention_window(layer) else "full"
            raise ValueError(f"kv_shared_layers {n}: layer {layer} ({kind} attention) has no "
                             f"earlier {kind} layer to reuse keys and values from")


def check_kv_sharing_layout(config, parallel) -> str | None:
    """Why `parallel` cannot run this KV sharing (one line), or None: the reused keys and values
    stay within one pipeline stage and one context-parallel rank's sequence."""
    if config.kv_shared_layers and (parallel.pp > 1 or parallel.cp > 1):
        return (f"kv_shared_layers {config.kv_shared_layers} needs --pipeline-model-parallel-size "
                f"1 and --context-parallel-size 1 (layers reuse earlier layers' keys and values "
                f"within one stage and sequence), got pp {parallel.pp}, cp {parallel.cp}")
    return None


def producers(config) -> frozenset[int]:
    """The layers whose keys and values later layers reuse."""
    sources = (kv_source(config, i) for i in range(config.num_layers))
    return frozenset(i for i in sources if i is not None)
