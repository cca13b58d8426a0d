"""The optimizer state of Megatron-LM's torch_dist checkpoints, in the forms it is saved in.

`common.pt` names the form: `content_metadata["distrib_optim_sharding_type"]` (and
`optimizer["param_state_sharding_type"]`) for the distributed optimizer
(`--use-distributed-optimizer`); neither for the plain optimizer.

- Plain optimizer (Megatron-core's `FP32Optimizer` / mixed-precision wrapper): model-space
  tensors `optimizer.state.{exp_avg,exp_avg_sq}.<model key>`, the fp32 masters of a 16-bit run
  as `optimizer.state.fp32_param.<model key>`, the Adam step as `common_step` in common.pt.
- `fully_reshardable` (`--dist-ckpt-optim-fully-reshardable`) and the older
  `fully_sharded_model_space`: model-space tensors too, the masters as `optimizer.state.param.`
  (`fp32_param.` in the older form); the step in the param groups of common.pt's `optimizer`.
- `dp_reshardable` (the distributed optimizer's default since core_v0.14): the optimizer's own
  flat buffers, one tensor per grad-buffer bucket and state,
  `optimizer.distributed.dp_group_idx_{M}.gbuf_idx_{G}.dtype_{dtypes}.bucket_idx_{B}.{param,
  exp_avg,exp_avg_sq}` [the bucket's unpadded length], M the model-parallel rank (TP x PP) that
  owns it; the buckets' lengths and the param groups (with the step) as ShardedObjects
  `optimizer.distributed.dp_group_idx_{M}.{per_bucket_numel_unpadded,optimizer}`. A bucket
  holds its parameters in reverse module order, each starting at a multiple of 64 elements (the
  layout megatron_distrib_optim.flat_ranges rebuilds for the legacy distrib_optim.pt).

`model_space(...)` returns the dp_reshardable state in the model-space form
(`optimizer.state.<state>.<model key>` -> global tensor), so one mapping reads all forms.
ShardedObjects are read from the .distcp bytes with the allowlist (torch's own reader unpickles
them with `weights_only=False`).
"""
from __future__ import annotations

import os
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import names, safe_load
from megazoo.training.checkpoint.foreign.megatron_distrib_optim import bucket_size, flat_ranges

MODEL_SPACE = "optimizer.state."
READ = ("fully_reshardable", "fully_sharded_model_space", "dp_reshardable")
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
_OBJECT = "optimizer.distributed.dp_group_idx_"
# the local spec's norms, stored under Transformer Engine's fused names in torch_dist
_STORED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_RESAVE = ("re-save it with Megatron-LM's --dist-ckpt-optim-fully-reshardable, or import the "
           "weights only (--no-optimizer)")


def sharding_type(common: dict) -> str | None:
    """The distributed optimizer's sharding type recorded in common.pt, None for the plain one."""
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    opt = common.get("optimizer")
    return kind or (opt.get("param_state_sharding_type") if isinstance(opt, dict) else None)


def check_readable(common: dict, folder: str) -> str | None:
    kind = sharding_type(common)
    if kind is not None and kind not in READ:
        raise ckpt.CheckpointError(f"{folder}: the distributed optimizer's state is saved as "
                                   f"'{kind}', which megazoo does not read; {_RESAVE}")
    return kind


def objects(folder: str, metadata, prefix: str) -> dict:
    """The ShardedObjects whose keys start with `prefix`, unpickled through the allowlist."""
    out = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefix) and index.offset is None:
            if getattr(info, "transform_descriptors", None):
                raise ckpt.CheckpointError(f"{folder}: {index.fqn} is stored transformed "
                                           f"({info.transform_descriptors}); not read")
            path = os.path.join(folder, info.relative_path)
            with open(path, "rb") as f:
                f.seek(info.offset)
                out[index.fqn] = safe_load.load(path, f.read(info.length))
    return out


def step(common: dict, folder: str, metadata) -> int | None:
    """The Adam step: common.pt's `common_step`, or the step of its (or the ShardedObjects')
    param groups."""
    opt = common.get("optimizer")
    groups = []
    for part in opt if isinstance(opt, list) else [opt]:
        if not isinstance(part, dict):
            continue
        inner = part.get("optimizer") or part  # the mixed-precision wrapper nests it
        if (inner.get("state") or {}).get("common_step") is not None:
            return int(inner["state"]["common_step"])
        groups += inner.get("param_groups") or []
    for key, value in objects(folder, metadata, _OBJECT).items():
        if key.split("/")[0].endswith(".optimizer"):
            for saved in value if isinstance(value, list) else [value]:
                groups += (saved or {}).get("param_groups") or []
    steps = {int(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise ckpt.CheckpointError(f"{folder}: optimizer groups at different steps {sorted(steps)}")
    return steps.pop() if steps else None


def bucket_keys(metadata) -> dict[str, tuple]:
    """The dp_reshardable bucket tensors: key -> (model-parallel rank, gbuf, dtypes, bucket,
    state)."""
    return {k: (int(m[1]), int(m[2]), m[3], int(m[4]), m[5])
            for k in metadata.state_dict_metadata if (m := _BUCKET.fullmatch(k))}


def module_order(shapes: dict[str, tuple], layers: int, te_spec: bool) -> list:
    """[(sharded key, layer index or None, shape)] of the model's parameters in Megatron-core's
    module order (the order of its optimizer and grad buffers), for a one-stage model."""
    order = [(k, None, shapes[k]) for k in ("embedding.word_embeddings.weight",
                                             "embedding.position_embeddings.weight") if k in shapes]
    for i in range(layers):
        for megatron, _, _ in names.LAYER:
            plain = next((p for p in _STORED_NORMS if megatron.startswith(p)), None)
            fused = ".layer_norm_" in megatron
            if (plain and te_spec) or (fused and not te_spec):
                continue  # the norm sits at the other spec's place
            stored = _STORED_NORMS[plain] + megatron[len(plain):] if plain else megatron
            stacked = "decoder.layers." + stored
            if stacked in shapes:
                order.append((stacked, i, shapes[stacked][1:]))
            elif f"decoder.layers.{i}.{stored}" in shapes:
                key = f"decoder.layers.{i}.{stored}"
                order.append((key, None, shapes[key]))
    order += [(k, None, shapes[k]) for k in ("decoder.final_layernorm.weight",
                                              "decoder.final_layernorm.bias",
                                              "output_layer.weight") if k in shapes]
    return order


def _split(key: str, swiglu: bool) -> str:
    """How Megatron splits a sharded key's tensor over TP (names.py's kinds)."""
    top = {m: split for m, _, split in names.TOP}
    if key in top:
        return top[key]
    rest = key[len("decoder.layers."):]
    layer, _, suffix = rest.partition(".")
    suffix = suffix if layer.isdigit() else rest  # kept per layer, or stacked
    return names.split_for(names.to_megazoo(f"decoder.layers.0.{suffix}")[1], swiglu)


def model_space(folder: str, metadata, args, model: dict[str, torch.Tensor]) -> dict:
    """The dp_reshardable buckets as model-space tensors: `optimizer.state.{param,exp_avg,
    exp_avg_sq}.<model key>` -> tensor of the model key's global shape (layers stacked as
    stored). Model-parallel rank M = TP rank here (one pipeline stage): its buckets hold the TP
    shards of every parameter, joined over TP as Megatron splits them."""
    buckets = bucket_keys(metadata)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    gbufs = {v[1] for v in buckets.values()}
    if pp != 1 or {v[0] for v in buckets.values()} != set(range(tp)) or gbufs != {0}:
        raise ckpt.CheckpointError(
            f"{folder}: the distributed optimizer's dp_reshardable state (saved at tp={tp} "
            f"pp={pp}, {len(gbufs)} grad buffer(s)) is read by megazoo for one pipeline stage "
            f"and one grad buffer only; {_RESAVE}")
    if any(".mlp.experts." in k or ".mlp.router." in k for k in model):
        raise ckpt.CheckpointError(f"{folder}: the distributed optimizer's dp_reshardable state "
                                   f"of a mixture-of-experts model is not read; {_RESAVE}")
    tensors = {k: torch.empty(tuple(metadata.state_dict_metadata[k].size),
                              dtype=metadata.state_dict_metadata[k].properties.dtype)
               for k in buckets}
    import torch.distributed.checkpoint as dcp
    dcp.load(tensors, storage_reader=safe_load.SafeDCPReader(folder), no_dist=True)
    flat = [{} for _ in range(tp)]  # per TP rank: state -> its buckets joined
    for key in sorted(buckets, key=lambda k: buckets[k][3]):  # buckets in order
        flat[buckets[key][0]].setdefault(buckets[key][4], []).append(tensors[key].float())
    flat = [{s: torch.cat(parts) for s, parts in f.items()} for f in flat]
    order = module_order({k: tuple(t.shape) for k, t in model.items()}, args.num_layers,
                         getattr(args, "transformer_impl", "transformer_engine") != "local")
    placed = {k for k, _, _ in order}
    if placed != set(model):
        raise ckpt.CheckpointError(f"{folder}: no place known in the optimizer's buckets for "
                                   f"{sorted(set(model) - placed)}; {_RESAVE}")
    swiglu = bool(getattr(args, "swiglu", False))
    splits = [_split(key, swiglu) for key, _, _ in order]
    parts: list[dict] = [{} for _ in order]  # per parameter: state -> [TP ranks' pieces]
    for rank, states in enumerate(flat):
        local = [names.shard(torch.empty(shape, device="meta"), split, rank, tp,
                             shape[0]).shape for (_, _, shape), split in zip(order, splits)]
        ranges, total = flat_ranges([int(s.numel()) for s in local], bucket_size(args),
                                    [False] * len(order))
        lengths = {len(t) for t in states.values()}
        if lengths != {total} or len(states) != 3:
            raise ckpt.CheckpointError(
                f"{folder}: TP rank {rank}'s optimizer buckets hold {sorted(lengths)} values of "
                f"{sorted(states)}, the model's parameters at bucket size {bucket_size(args)} "
                f"lay out {total}; {_RESAVE}")
        for p, (shape, (a, b)) in enumerate(zip(local, ranges)):
            for state, values in states.items():
                parts[p].setdefault(state, []).append(values[a:b].view(shape))
    out = {}
    for (key, layer, _), split, by_state in zip(order, splits, parts):
        for state, pieces in by_state.items():
            name = f"{MODEL_SPACE}{state}.{key}"
            whole = names.unshard(pieces, split)
            if layer is None:
                out[name] = whole
            else:
                out.setdefault(name, torch.empty(model[key].shape))[layer] = whole
    return out


def common_optimizer(shapes: dict[str, tuple], layers: int, step: int, fp32: bool) -> dict:
    """The optimizer entry of common.pt as Megatron-core's plain optimizer saves it (its state's
    tensors are the model-space ones): torch Adam's param groups without their `params` (the
    loading run supplies them), one per weight-decay multiplier in first-seen module order
    (biases and 1-D tensors without weight decay), the step as `common_step`; nested in the
    mixed-precision wrapper's `optimizer` unless fp32. No groups (as before) for a model with
    parameters outside the known module order (routed experts)."""
    adam = {"state": {"common_step": torch.tensor(float(step))}}
    order = module_order(shapes, layers, te_spec=False)
    if {k for k, _, _ in order} == set(shapes):
        wd = list(dict.fromkeys(0.0 if k.endswith(".bias") or len(shape) == 1 else 1.0
                                for k, _, shape in order))
        adam["param_groups"] = [dict(wd_mult=w, lr_mult=1.0, is_expert_parallel=False,
                                     is_decoupled_lr=False, lr=0.0, weight_decay=0.0,
                                     betas=(0.9, 0.999), eps=1e-8, amsgrad=False) for w in wd]
    return adam if fp32 else {"optimizer": adam}
