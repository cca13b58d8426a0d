"""The dry run of a hybrid model (Qwen3.5, Qwen3-Next, Nemotron-H) beside its plan: the family's
own model built on the `meta` device at full size, its parameters counted as built against the
planner's layer-kind counts, and one context-parallel rank's forward (s / cp tokens) run on meta
with the bytes autograd saves measured per layer, against the planner's per-layer estimate.

A context-parallel rank of a hybrid model runs its contiguous slice of the sequence: its linear
layers start from the state the previous rank hands over (a constant-size tensor, not part of
what it saves), its attention layers keep their local queries, keys, values and output (ring
attention); so the slice run alone is the rank's activation footprint. Tensor parallelism is
not applied (the family models are single-device): the measurement is of tp 1, and the plan's
per-layer figure is compared at tp 1 too. MoE layers route by value, which meta tensors do not
have: their bytes are the planner's alone (`measured` None).

`measure_saved_bytes` is the measurement (a saved-tensor hook, each storage counted once,
parameters left out), also used on real CPU tensors by the tests.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megazoo.models import hybrid_counts as hc

from megazoo.training.planning import hybrid
from megazoo.training.planning.layout import Layout
from megazoo.training.planning.meta_kernels import device_kernels_on_meta
from megazoo.training.planning.step_time import Cluster


@dataclass
class HybridDryRun:
    plan: hybrid.HybridPlan
    built_parameters: int  # the model as built on meta (the tied head once)
    counted_parameters: int  # models/hybrid_counts.py
    layers: list = field(default_factory=list)  # (index, kind, measured bytes | None, predicted)

    def by_kind(self) -> dict:
        """kind -> (measured, predicted) bytes summed over the measured layers of that kind."""
        out: dict[str, list[float]] = {}
        for _, kind, measured, predicted in self.layers:
            if measured is not None:
                acc = out.setdefault(kind, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + measured, acc[1] + predicted
        return {k: tuple(v) for k, v in out.items()}


def layer_modules(model) -> list:
    """The decoder layers of a family model (`model.model.layers`, transformers' layout)."""
    return list(model.model.layers)


@contextlib.contextmanager
def measure_saved_bytes(model):
    """Yields a dict: layer index -> bytes autograd saved inside that layer (each storage once,
    the model's parameters left out); "other" for what is saved outside the layers."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    counted: dict = {}
    seen: set = set()
    current = ["other"]
    hooks = []
    for i, layer in enumerate(layer_modules(model)):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, "other")))

    def pack(t):
        storage = t.untyped_storage()  # a new wrapper each call; _cdata names the storage itself
        if storage._cdata not in seen and storage._cdata not in params:
            seen.add(storage._cdata)
            counted[current[0]] = counted.get(current[0], 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counted
    finally:
        for h in hooks:
            h.remove()


def dry_run(config, model_class, layout: Layout, cluster: Cluster, measure: bool = True) -> HybridDryRun:
    """Plan `config` at `layout`, build `model_class(config)` on meta and measure one cp rank's
    forward (micro batch x seq_length / cp tokens) layer by layer."""
    shape = hc.describe(config)
    p = hybrid.plan(shape, layout, cluster)
    with torch.device("meta"):
        model = model_class(config).to(layout.dtype)
    built = sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())
    report = HybridDryRun(p, built, hc.num_parameters(shape))
    one = layout.replace(tp=1, sequence_parallel=False)
    predicted = [hybrid.layer_activation_bytes(shape, one, i) for i in range(shape.num_layers)]
    moe = [isinstance(layer.mlp, hc.MoEMLP) for layer in shape.layers]
    if not measure or any(moe):
        report.layers = [(i, shape.layers[i].kind, None, predicted[i]) for i in range(shape.num_layers)]
        return report
    tokens = torch.zeros(layout.micro_batch_size, layout.seq_length // layout.cp, dtype=torch.long,
                         device="meta")
    with device_kernels_on_meta(), measure_saved_bytes(model) as saved:
        model(tokens)
    report.layers = [(i, shape.layers[i].kind, saved.get(i, 0), predicted[i])
                     for i in range(shape.num_layers)]
    return report


def hybrid_preset(name: str):
    """(config, model class) of a Qwen3.5 / Qwen3-Next / Nemotron-H preset (the family folders'
    presets.py), or None: how `tools/dry_run.py --model` reaches a hybrid family the registry
    does not list."""
    from megazoo.models.nemotron_h import model as nemotron_h, presets as nemotron_h_presets
    from megazoo.models.qwen3_5 import model as qwen3_5, presets as qwen3_5_presets
    from megazoo.models.qwen3_next import model as qwen3_next, presets as qwen3_next_presets
    for presets, cls in ((qwen3_5_presets, qwen3_5.Qwen35ForCausalLM),
                         (qwen3_next_presets, qwen3_next.Qwen3NextForCausalLM),
                         (nemotron_h_presets, nemotron_h.NemotronHForCausalLM)):
        # transformers' fields (HF_PRESETS once a folder also lists TransformerConfig presets)
        if name in getattr(presets, "HF_PRESETS", presets.PRESETS):
            return presets.preset_config(name), cls
    return None


def report_text(name: str, r: HybridDryRun) -> str:
    """The plan's lines, the parameter check and each layer kind's measured vs planned bytes."""
    gib = 2 ** 30
    lines = [hybrid.describe_plan(name, r.plan),
             f"  parameters: built {r.built_parameters:,}, counted {r.counted_parameters:,}"
             f" ({'equal' if r.built_parameters == r.counted_parameters else 'DIFFERENT'})"]
    for kind, (measured, planned) in sorted(r.by_kind().items()):
        lines.append(f"  {kind}: one cp rank (tp 1) saves {measured / gib:.2f} GiB over its layers, "
                     f"planned {planned / gib:.2f} GiB ({measured / planned:.3f}x)")
    if not r.by_kind():
        lines.append("  activations not measured on meta (MoE routing needs values): planned only")
    return "\n".join(lines)
