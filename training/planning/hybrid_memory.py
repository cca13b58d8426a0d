"""What a hybrid model's pipeline rank keeps for backward (training/planning/hybrid.py plans with
it; memory.py hands it a TransformerConfig whose token mixers are hybrid kinds): each of the rank's
layers by its kind (models/hybrid_counts.py), over the microbatch chunks its schedule keeps alive.
Imports no other planning module, so memory.py and hybrid.py both call it without a cycle."""
from __future__ import annotations

from megazoo.models import hybrid_counts as hc
from megazoo.parallel.pipeline.schedules import activation_bound

from megazoo.training.planning.layout import Layout


def padded_vocab(shape: hc.HybridShape, tp: int, multiple: int = 128) -> int:
    m = multiple * tp
    return -(-shape.vocab_size // m) * m


def rank_layer_ids(shape: hc.HybridShape, layout: Layout, pp_rank: int) -> list[int]:
    """The layers pipeline rank `pp_rank` holds, as the trainer partitions them."""
    specs = layout.parallel.chunk_specs(shape.num_layers, pp_rank)
    return [i for spec in specs for i in range(*spec.layer_range)]


def layer_activation_bytes(shape: hc.HybridShape, layout: Layout, i: int) -> float:
    """Bytes layer `i` keeps for one microbatch on one rank: s/cp tokens of what its kind keeps
    (models/hybrid_counts.py `layer_activation_bytes`, in the weights' dtype)."""
    tok, seq = hc.layer_activation_bytes(shape, i, layout.tp, layout.sequence_parallel,
                                         layout.dtype.itemsize)
    s, b = layout.seq_length / layout.cp, layout.micro_batch_size
    return (tok * s + seq) * b


def activation_bytes(shape: hc.HybridShape, layout: Layout, pp_rank: int, schedule: str) -> float:
    """Activation bytes pipeline rank `pp_rank` keeps at its peak: its layers' for the microbatch
    chunks its schedule keeps alive (full recompute: each layer's input, plus one layer's whole),
    the token ids on the first stage, the final norm's input and the fused head's gradient of
    the logits (s b V / t) on the last. `schedule`: the pipeline schedule the trainer runs
    (memory.py's `pipeline_schedule`)."""
    s, b, h, t = layout.seq_length / layout.cp, layout.micro_batch_size, shape.hidden_size, layout.tp
    e = layout.dtype.itemsize
    u = t if layout.sequence_parallel else 1
    units = activation_bound(schedule, layout.pp, pp_rank,
                             max(layout.microbatches, 1), layout.vpp)
    per_layer = [layer_activation_bytes(shape, layout, i)
                 for i in rank_layer_ids(shape, layout, pp_rank)]
    if layout.recompute_granularity == "full":
        total = len(per_layer) * e * s * b * h / u / layout.vpp * units + max(per_layer, default=0.0)
    else:
        total = sum(per_layer) / layout.vpp * units
    if pp_rank == 0:
        total += 8 * s * b * min(layout.pp, max(layout.microbatches, 1))
    if pp_rank == layout.pp - 1:
        total += (4 + e) * s * b * h / u + e * s * b * h + 4 * s * b * padded_vocab(shape, t) / t
    return total
