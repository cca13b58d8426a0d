"""Megatron-core's `torch_dist` checkpoints (`--ckpt-format torch_dist`) in and out.

Layout of one iteration folder (the root's `latest_checkpointed_iteration.txt` names it, as for
legacy checkpoints):

    iter_0000200/metadata.json      {"sharded_backend": "torch_dist", ...}
    iter_0000200/.metadata          PyTorch distributed-checkpoint index of every tensor
    iter_0000200/__R_S.distcp       the tensors' bytes
    iter_0000200/common.pt          everything not sharded: args, iteration, scheduler, the
                                    optimizer's parameter groups and its common Adam step

Tensors are saved whole (global shapes; TP and PP are only how ranks wrote their parts), under
Megatron-core's sharded names: transformer layers stacked along a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` [layers, ...]) or kept per layer, norms under
Transformer Engine's fused names whatever spec trained them, SwiGLU `linear_fc1` as the whole
[gate; up], the vocabulary padded; routed experts as `decoder.layers.mlp.experts.experts.
linear_fc{1,2}.weight` [layers, experts, ...] (every layer an MoE layer). Optimizer states are `optimizer.state.{exp_avg,exp_avg_sq}.`
and the fp32 masters `optimizer.state.fp32_param.` before the parameter's key.
`torch.distributed.checkpoint` reads and writes them in one process (`no_dist`).
"""
from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import megatron_args, megatron_mla, names, safe_load
from megazoo.training.checkpoint.foreign import megatron_dist_optim as dist_optim
from megazoo.training.checkpoint.foreign.assemble import check_shapes, expected_shapes
from megazoo.training.checkpoint.foreign.megatron_legacy import TRACKER, iteration_folder, scheduler_state
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

_STACKED = "decoder.layers."
_OPTIM = {"exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq.",
          "master": "optimizer.state.fp32_param."}
# read: the masters are `param.` in the distributed optimizer's model-space forms
_READ_OPTIM = [(s, p) for s, p in _OPTIM.items()] + [("master", "optimizer.state.param.")]
# sharded names of the routed experts: [layers, experts, ...] (SequentialMLP's sharded form)
_EXPERTS = "mlp.experts.experts."
_BY_EXPERT = {_EXPERTS + m: z for m, z, _ in names.EXPERT}
# sharded names of the norms (Megatron-core saves the local spec's norms under TE's names)
_SHARDED_NORMS = {"input_norm": "self_attention.linear_qkv.layer_norm_",
                  "post_attention_norm": "mlp.linear_fc1.layer_norm_"}


def _folder(root: str) -> tuple[str, int | None]:
    if os.path.isfile(os.path.join(root, "metadata.json")):
        base = os.path.basename(os.path.normpath(root))
        return root, int(base[5:]) if base.startswith("iter_") and base[5:].isdigit() else None
    return iteration_folder(root)


def is_dist(root: str) -> bool:
    try:
        folder, _ = _folder(root)
        return json.load(open(os.path.join(folder, "metadata.json"))).get(
            "sharded_backend") == "torch_dist"
    except (ckpt.CheckpointError, OSError, ValueError):
        return False


def _common(folder: str) -> dict:
    path = os.path.join(folder, "common.pt")
    if not os.path.isfile(path):
        raise ckpt.CheckpointError(f"{path} is missing; the torch_dist checkpoint is incomplete")
    return safe_load.load(path)


def describe(root: str) -> str:
    folder, iteration = _folder(root)
    common = _common(folder)
    args = common.get("args")
    tensors = len(safe_load.SafeDCPReader(folder).read_metadata().state_dict_metadata)
    optim = ("no optimizer" if not common.get("optimizer") else
             f"distributed optimizer ({dist_optim.sharding_type(common)})"
             if dist_optim.sharding_type(common) else "optimizer")
    return (f"Megatron-core torch_dist checkpoint ({'release' if iteration is None else f'iteration {iteration}'}), "
            f"saved at tp={args.tensor_model_parallel_size} pp={args.pipeline_model_parallel_size}: "
            f"{tensors} tensors, {args.num_layers} layers, hidden {args.hidden_size}, {optim}")


def _megazoo_name(key: str, layers: int):
    """[(canonical name, layer index into a stacked tensor or None)] of one sharded key."""
    if key.startswith(_STACKED) and not key[len(_STACKED)].isdigit():
        suffix = key[len(_STACKED):]
        if suffix in _BY_EXPERT:  # [layers, experts, ...]: megazoo stacks experts likewise
            return [(f"layers.{i}.{_BY_EXPERT[suffix]}", i) for i in range(layers)]
        out = []
        for i in range(layers):
            mapped = names.to_megazoo(f"decoder.layers.{i}.{suffix}")
            if mapped is None:
                return []
            out.append((mapped[0], i))
        return out
    layer, _, suffix = key[len(_STACKED):].partition(".")
    if key.startswith(_STACKED) and suffix in _BY_EXPERT:  # one layer's [experts, ...]
        return [(f"layers.{layer}.{_BY_EXPERT[suffix]}", None)]
    mapped = names.to_megazoo(key)
    return [] if mapped is None else [(mapped[0], None)]


def read(root: str, vocab_size: int | None = None, *, optimizer: bool = True):
    """(family, config, FullState, iteration) of a torch_dist checkpoint (see `megatron_legacy.read`)."""
    folder, iteration = _folder(root)
    common = _common(folder)
    args = common.get("args")
    family, config = megatron_args.to_config(args, folder, vocab_size)
    index = safe_load.SafeDCPReader(folder).read_metadata()
    metadata = index.state_dict_metadata
    kind = dist_optim.check_readable(common, folder) if optimizer else None
    wanted = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    model_keys = [k for k in wanted if not k.startswith("optimizer.")]
    keys = model_keys + ([k for k in wanted if k.startswith(dist_optim.MODEL_SPACE)]
                         if optimizer else [])
    tensors = {k: torch.empty(tuple(wanted[k].size), dtype=wanted[k].properties.dtype)
               for k in keys}
    dcp.load(tensors, storage_reader=safe_load.SafeDCPReader(folder), no_dist=True)
    if kind == "dp_reshardable":  # the optimizer's flat buckets, laid out as the model
        tensors.update(dist_optim.model_space(folder, index, args,
                                              {k: tensors[k] for k in model_keys}))
    prefixes = [("weights", "")] + (_READ_OPTIM if optimizer else [])
    out = {g: {} for g, _ in prefixes}
    for key, t in tensors.items():
        group, prefix = next(((g, p) for g, p in prefixes[1:] if key.startswith(p)),
                             prefixes[0])
        model_key = key[len(prefix):]
        try:
            mapped = _megazoo_name(model_key, config.num_layers)
        except KeyError:
            raise ckpt.CheckpointError(f"{folder}: {model_key} is not a tensor megazoo maps") from None
        for canon, layer in mapped:
            if canon == "head_weight" and config.tie_word_embeddings:
                continue  # the tied embedding's copy
            value = t[layer] if layer is not None else t
            if canon.endswith("word_embeddings.weight") or canon == "head_weight":
                value = value[:config.vocab_size]
            out[group][canon] = value.float()
    expected, frozen = expected_shapes(family, config, frozen=True)
    check_shapes(out["weights"], expected, folder, f"its args (hidden_size={args.hidden_size}, "
                 f"num_attention_heads={args.num_attention_heads}, padded_vocab_size="
                 f"{args.padded_vocab_size})")
    optim = {}
    if optimizer and common.get("optimizer") and not out.get("exp_avg"):
        raise ckpt.CheckpointError(f"{folder}: common.pt records an optimizer whose state "
                                   f"megazoo found no tensors of; import the weights only "
                                   f"(--no-optimizer)")
    if optimizer and out.get("exp_avg"):
        if not out["master"]:  # fp32 training: the weights are the masters
            out["master"] = {k: v for k, v in out["weights"].items() if k not in frozen}
        if any(set(out[s]) != set(expected) - frozen for s in _OPTIM):
            raise ckpt.CheckpointError(f"{folder}: optimizer state covers only part of the model; "
                                       f"import the weights only (--no-optimizer)")
        optim = {s: out[s] for s in _OPTIM}
    it = iteration if iteration is not None else int(common.get("iteration", 0) or 0)
    step = dist_optim.step(common, folder, index) if optim else None
    step = step if step is not None else it
    scalars = {"iteration": torch.tensor(it), "applied_steps": torch.tensor(step)} if optim else {}
    meta = dict(consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                skipped_steps=max(it - step, 0), seq_length=getattr(args, "seq_length", None),
                source=dict(format="megatron-dist", folder=os.path.abspath(folder),
                            scheduler=scheduler_state(common.get("opt_param_scheduler"))))
    return family, config, FullState(meta, out["weights"], optim, scalars), it


def _sharded_key(canon: str, mla: bool = False) -> tuple[str, int | None]:
    """(sharded key, layer or None) of a megazoo canonical name; `mla`: Megatron-core's local MLA
    spec, which keeps its norms' own names in the sharded state dict."""
    top = {z: m for m, z, _ in names.TOP}
    if canon in top:
        return top[canon], None
    if canon.startswith("mtp.depths."):  # an MTP depth's tensors: kept per depth, not stacked
        _, _, depth, rest = canon.split(".", 3)
        own = {z: m for m, z, _ in megatron_mla.MTP}
        if rest in own:
            return f"mtp.layers.{depth}.{own[rest]}", None
        key, _ = _sharded_key("layers.0." + rest[len("layer."):], mla)
        return f"mtp.layers.{depth}.transformer_layer.{key[len(_STACKED):]}", None
    _, layer, rest = canon.split(".", 2)
    base, _, kind = rest.rpartition(".")
    if base in _SHARDED_NORMS and not mla:
        return _STACKED + _SHARDED_NORMS[base] + kind, int(layer)
    experts = {z: m for m, z in _BY_EXPERT.items()}
    if rest in experts:
        return _STACKED + experts[rest], int(layer)
    megatron = {z: m for m, z, _ in names.LAYER if ".layer_norm_" not in m}
    return _STACKED + megatron[rest], int(layer)


_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")


_SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def _stacked(config) -> bool:
    """Whether Megatron-core stacks the layers along a leading axis: not when dense and MoE
    layers alternate (moe_layer_freq > 1 or a per-layer list: its `non_homogeneous_layers`)."""
    return not (config.num_experts and (config.moe_layer_freq > 1 or config.moe_first_dense_layers))


def _extra_states(config, written) -> dict[str, list]:
    """The `_extra_state` objects every Megatron-core linear layer saves (None outside FP8
    training; stored as the pickled list of a shard's objects), one per layer (and expert),
    under Megatron-core's `key/shard_{offsets}_{shape}` names; its loader requires them. The
    dense linears (attention, MLA's projections, dense MLP, shared expert) are those whose
    weights are `written`."""
    layers, experts, stacked = config.num_layers, config.num_experts or 0, _stacked(config)
    out = {}
    for i in range(layers):
        moe = config.is_moe_layer(i)
        for m in _LINEARS + megatron_mla.LINEARS + _SHARED:
            if stacked and f"{_STACKED}{m}.weight" in written:
                out[f"{_STACKED}{m}._extra_state/shard_{i}_{layers}"] = [None]
            elif not stacked and f"{_STACKED}{i}.{m}.weight" in written:
                out[f"{_STACKED}{i}.{m}._extra_state/shard_0_1"] = [None]
        for m in ("linear_fc1", "linear_fc2") if moe else ():
            for e in range(experts):
                out[f"{_STACKED}{_EXPERTS}{m}._extra_state/shard_{i}.{e}_{layers}.{experts}"
                    if stacked else
                    f"{_STACKED}{i}.{_EXPERTS}{m}._extra_state/shard_{e}_{experts}"] = [None]
    out["output_layer._extra_state/shard_0_1"] = [None]
    for key in written:  # MTP depths: eh_proj and their layer's linears, one shard each
        if key.startswith("mtp.layers.") and key.endswith(".weight") and any(
                key[:-len(".weight")].endswith(m) for m in ("eh_proj",) + _LINEARS
                + megatron_mla.LINEARS):
            out[f"{key[:-len('.weight')]}._extra_state/shard_0_1"] = [None]
    return out


def write(full: FullState, config, root: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
          iteration: int = 0) -> str:
    """A megazoo FullState as a torch_dist checkpoint that Megatron-core's
    `dist_checkpointing.load` reads into a model of any (tp, pp) it was configured with."""
    megatron_args.check_exportable(config, root)
    padded = config.padded_vocab_size(tp)
    stacked = _stacked(config)
    per_layer: dict[str, list] = {}
    tensors = {}
    sources = {"": full.weights} | ({p: full.optim[s] for s, p in _OPTIM.items()}
                                    if full.optim else {})
    for prefix, values in sources.items():
        for canon, t in values.items():
            key, layer = _sharded_key(canon, bool(config.kv_lora_rank))
            if layer is not None and not stacked:  # one tensor per layer, numbered globally
                key, layer = f"{_STACKED}{layer}.{key[len(_STACKED):]}", None
            # the optimizer's states and the expert bias (a buffer Megatron keeps in fp32)
            dtype = torch.float32 if prefix or canon.endswith(".expert_bias") else config.dtype
            if key.startswith(("embedding.word", "output_layer")):
                t = names.shard(t, "vocab", 0, 1, padded)
            if layer is None:
                tensors[prefix + key] = t.to(dtype).contiguous()
            else:
                per_layer.setdefault(prefix + key, [None] * config.num_layers)[layer] = t.to(dtype)
    tensors.update({k: torch.stack(v).contiguous() for k, v in per_layer.items()})
    tensors.update(_extra_states(config, tensors))
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    consumed = int(full.meta.get("consumed_samples", 0) or 0)
    args = megatron_args.from_config(config, tp=tp, pp=pp, vpp=vpp, iteration=iteration,
                                     consumed_samples=consumed,
                                     seq_length=full.meta.get("seq_length"))
    args.ckpt_format = "torch_dist"
    step = int(full.scalars.get("applied_steps", torch.tensor(iteration)))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "opt_param_scheduler": scheduler_state((full.meta.get("source") or {}).get(
                    "scheduler"), consumed),
                "optimizer": dist_optim.common_optimizer(
                    {k: tuple(t.shape) for k, t in tensors.items() if isinstance(t, torch.Tensor)
                     and not k.startswith("optimizer.")}, config.num_layers, step,
                    config.params_dtype == "float32") if full.optim else None,
                "num_floating_point_operations_so_far": 0}, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    logger.info("wrote torch_dist checkpoint %s (%d tensors, iteration %d)", folder, len(tensors),
                iteration)
    return folder
