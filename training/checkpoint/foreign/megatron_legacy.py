"""Megatron-LM's legacy checkpoints (`--ckpt-format torch`) in and out.

Layout (Megatron-LM's training/checkpointing.py):

    ROOT/latest_checkpointed_iteration.txt     "200" or "release"
    ROOT/iter_0000200/ (or ROOT/release/)
        mp_rank_TT/model_optim_rng.pt          pipeline size 1, no expert parallelism
        mp_rank_TT_PPP/model_optim_rng.pt      with pipeline parallelism
        mp_rank_TT[_PPP]_EEE/...               with expert parallelism (EEE: expert rank)

Each file is a pickle of {args, checkpoint_version, iteration, model (or model0..N for virtual
stages), optimizer, opt_param_scheduler, rng_state}; `model` is the stage's Megatron-core
state dict with layer indices local to the stage (chunk v of pipeline rank p starts at layer
(v * pp + p) * layers per chunk). The optimizer is torch's Adam state dict with Megatron's
parameter groups (megatron_legacy_optim.py reads and writes it); with
`--use-distributed-optimizer` the masters and moments are in `distrib_optim.pt` next to the model
file instead (megatron_distrib_optim.py).
"""
from __future__ import annotations

import logging
import os
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import megatron_args, megatron_mla, megatron_moe, names
from megazoo.training.checkpoint.foreign import safe_load
from megazoo.training.checkpoint.foreign import megatron_distrib_optim as distrib_optim
from megazoo.training.checkpoint.foreign import megatron_legacy_model as legacy_model
from megazoo.training.checkpoint.foreign import megatron_legacy_optim as legacy_optim
from megazoo.training.checkpoint.foreign.megatron_legacy_optim import STATES
from megazoo.training.checkpoint.foreign.assemble import Pieces, check_shapes, expected_shapes
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_MODEL_FILES = ("model_optim_rng.pt", "model_rng.pt")


def iteration_folder(root: str) -> tuple[str, int | None]:
    """(iter_*/release folder, iteration or None for a release) of a Megatron-LM --save root or
    of one of its iteration folders."""
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text == "release":
            return os.path.join(root, "release"), None
        if not text.isdigit():
            raise ckpt.CheckpointError(f"{tracker}: {text!r} is neither an iteration nor 'release'")
        return os.path.join(root, f"iter_{int(text):07d}"), int(text)
    base = os.path.basename(os.path.normpath(root))
    if any(_RANK_DIR.fullmatch(n) for n in _listdir(root)):
        m = re.fullmatch(r"iter_(\d+)", base)
        return root, int(m[1]) if m else None
    raise ckpt.CheckpointError(f"{root}: no {TRACKER} and no mp_rank_* folders; pass a Megatron-LM "
                               f"--save folder or one of its iter_* folders")


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def is_legacy(root: str) -> bool:
    try:
        folder, _ = iteration_folder(root)
    except ckpt.CheckpointError:
        return False
    return any(_RANK_DIR.fullmatch(n) for n in _listdir(folder))


def rank_files(folder: str, pp: int, ep: int) -> dict[tuple[int, int, int], str]:
    """(tp rank, pp rank, ep rank) -> model file; the folder names' second number is the
    pipeline rank with pipeline parallelism, else the expert rank."""
    files = {}
    for name in _listdir(folder):
        m = _RANK_DIR.fullmatch(name)
        if not m:
            continue
        nums = [int(x) for x in m.groups() if x is not None]
        t, rest = nums[0], nums[1:]
        p = rest.pop(0) if pp > 1 and rest else 0
        e = rest.pop(0) if ep > 1 and rest else 0
        path = next((os.path.join(folder, name, f) for f in _MODEL_FILES
                     if os.path.isfile(os.path.join(folder, name, f))), None)
        if path is None:
            raise ckpt.CheckpointError(f"{os.path.join(folder, name)} holds no model_optim_rng.pt")
        files[(t, p, e)] = path
    return files


def _first_file(folder: str) -> str:
    for name in _listdir(folder):
        if _RANK_DIR.fullmatch(name):
            for f in _MODEL_FILES:
                if os.path.isfile(os.path.join(folder, name, f)):
                    return os.path.join(folder, name, f)
    if os.path.isfile(os.path.join(folder, "metadata.json")):  # Megatron-LM's default format
        raise ckpt.CheckpointError(f"{folder}: a torch_dist checkpoint (metadata.json, *.distcp), "
                                   f"not a legacy one; import it with --format megatron-dist")
    raise ckpt.CheckpointError(f"{folder}: no mp_rank_*/model_optim_rng.pt")


def describe(root: str) -> str:
    """One line: format, iteration, layout and model of a legacy checkpoint (inspect tool)."""
    folder, iteration = iteration_folder(root)
    args = safe_load.load(_first_file(folder)).get("args")
    tp, pp, ep, vpp = _layout(args)
    return (f"Megatron-LM legacy checkpoint ({'release' if iteration is None else f'iteration {iteration}'}): "
            f"tp={tp} pp={pp} ep={ep} vpp={vpp}, {args.num_layers} layers, hidden "
            f"{args.hidden_size}, {args.num_attention_heads} heads, padded vocabulary "
            f"{args.padded_vocab_size}")


def _layout(args) -> tuple[int, int, int, int]:
    return (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            getattr(args, "expert_model_parallel_size", 1) or 1,
            getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def _param_items(model: dict, buffers: bool = False):
    """(key, tensor) of the stage's parameters in module order (FP8 state left out, and the
    router's expert-bias buffer unless `buffers`: the optimizer holds no state for it)."""
    return [(k, v) for k, v in model.items()
            if isinstance(v, torch.Tensor) and not names.IGNORED.fullmatch(k)
            and (buffers or not megatron_moe.BUFFERS.fullmatch(k))]


def read(root: str, vocab_size: int | None = None, *, optimizer: bool = True):
    """(family, config, FullState) of a Megatron-LM legacy checkpoint: full weights, and with
    `optimizer` the fp32 masters and Adam moments where the files hold them, the Adam step
    count, iteration, consumed samples and the scheduler's state (in meta)."""
    folder, iteration = iteration_folder(root)
    first = safe_load.load(_first_file(folder))
    args = first.get("args")
    family, config = megatron_args.to_config(args, folder, vocab_size)
    tp, pp, ep, vpp = _layout(args)
    offsets = megatron_moe.stage_offsets(args, config.num_layers, pp, vpp, folder)
    files = rank_files(folder, pp, ep)
    want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    if set(files) != want:
        raise ckpt.CheckpointError(f"{folder}: holds rank folders for {sorted(files)}, the recorded "
                                   f"tp={tp} pp={pp} ep={ep} call for {sorted(want)}")
    local_experts = (config.num_experts or 0) // ep
    weights = Pieces(folder)
    states = {s: Pieces(folder) for s in ("master",) + STATES}
    steps, sched, optim_found = set(), first.get("opt_param_scheduler"), []
    for (t, p, e), path in sorted(files.items()):
        sd = first if path == _first_file(folder) else safe_load.load(path)
        models = legacy_model.stage_models(sd, vpp, path, args.num_attention_heads // tp, optimizer)
        params = [(f"{v}:{k}", x) for v, m in enumerate(models) for k, x in _param_items(m)]
        if not optimizer:
            assigned = {}
        elif distrib_optim.path_for(path):
            assigned = distrib_optim.assign(
                [[(f"{v}:{k}", x) for k, x in _param_items(m)] for v, m in enumerate(models)],
                sd, path, args, shared_embedding=config.tie_word_embeddings and pp > 1)
        else:
            assigned = legacy_optim.assign(params, sd, path)
        optim_found.append(bool(assigned))
        for v, model in enumerate(models):
            offset = offsets[(p, v)]
            for file_key, file_tensor in _param_items(model, buffers=True):
                found = assigned.get(f"{v}:{file_key}")
                if found is not None and "step" in found[0]:
                    steps.add(int(found[0]["step"]))
                # a legacy GroupedMLP weight becomes its experts' tensors (states alike)
                parts = {n: dict(megatron_moe.expand_grouped(file_key, x, local_experts,
                                                              config.hidden_size))
                         for n, x in [("weights", file_tensor)] + (
                             [("master", found[1])] + [(s, found[0][s]) for s in STATES
                                                       if s in found[0]] if found else [])}
                for key, tensor in parts["weights"].items():
                    try:
                        mapped = names.to_megazoo(key, offset)
                    except KeyError:
                        raise ckpt.CheckpointError(
                            f"{path}: {key} is not a tensor megazoo maps (GPT, Llama, Qwen, "
                            f"Mixtral, Qwen-MoE, DeepSeek-V3 MLA and MoE layers in "
                            f"Megatron-core names)") from None
                    canon, split, expert = mapped
                    split = names.split_for(split, config.gated_mlp)
                    if split == "down":
                        split = megatron_mla.down_split(canon, tensor, config)
                    if expert is not None:
                        expert += e * local_experts
                    elif e > 0:
                        continue  # dense tensors: every expert rank holds the same copy
                    copy = (p, v)
                    if canon == "head_weight" and config.tie_word_embeddings:
                        canon = "embedding.word_embeddings.weight"  # the last stage's copy
                    weights.add(canon, split, expert, t, tensor, copy)
                    for s in parts.keys() - {"weights"}:
                        states[s].add(canon, split, expert, t, parts[s][key].float(), copy)
    expected, frozen = expected_shapes(family, config, frozen=True)
    recorded = (f"its args (hidden_size={args.hidden_size}, num_attention_heads="
                f"{args.num_attention_heads}, num_query_groups={config.num_query_groups}, "
                f"padded_vocab_size={args.padded_vocab_size}, ffn_hidden_size={config.ffn_hidden_size})")
    full_weights = weights.full(tp, config.vocab_size)
    check_shapes(full_weights, expected, folder, recorded)
    optim = {}
    if optimizer and all(optim_found) and optim_found:
        optim = {s: pieces.full(tp, config.vocab_size) for s, pieces in states.items()}
        if any(set(v) != set(expected) - frozen for v in optim.values()):
            raise ckpt.CheckpointError(f"{folder}: optimizer state covers only part of the "
                                       f"model; import the weights only (--no-optimizer)")
    elif optimizer and any(optim_found):
        raise ckpt.CheckpointError(f"{folder}: only some rank files hold optimizer state; import "
                                   f"the weights only (--no-optimizer)")
    it = iteration if iteration is not None else int(first.get("iteration", 0) or 0)
    step = max(steps) if steps else it
    scalars = {"iteration": torch.tensor(it), "applied_steps": torch.tensor(step)} if optim else {}
    meta = dict(consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                skipped_steps=max(it - step, 0), seq_length=getattr(args, "seq_length", None),
                source=dict(format="megatron", folder=os.path.abspath(folder),
                            layout=dict(tp=tp, pp=pp, ep=ep, vpp=vpp),
                            scheduler=scheduler_state(sched)))
    return family, config, FullState(meta, {k: v.float() for k, v in full_weights.items()},
                                     optim, scalars), it


def _plain(obj):
    """JSON-able values (for meta.json)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)


_SCHEDULER_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                   "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def scheduler_state(recorded: dict | None, consumed: int | None = None) -> dict | None:
    """Megatron's scheduler state as plain values (kept in meta.json on import). With `consumed`
    (export): every key Megatron-LM's loader reads, those no source recorded as None (then load
    with --override-opt_param-scheduler) and `num_steps` counted in samples."""
    state = _plain(recorded) if recorded else None
    if consumed is None:
        return state
    out = {k: (state or {}).get(k) for k in _SCHEDULER_KEYS}
    out["num_steps"] = (state or {}).get("num_steps", consumed)
    return out


def _stage_entries(full: dict, config, stage: int, stages: int):
    """[(Megatron key, canonical name, split, expert)] of one virtual stage in module order."""
    per_chunk = config.num_layers // stages
    swiglu = config.gated_mlp
    out = []
    if stage == 0:
        out += [(m, z, s, None) for m, z, s in names.TOP[:2] if z in full]
    for local in range(per_chunk):
        prefix = f"layers.{stage * per_chunk + local}."
        suffixes = {k[len(prefix):] for k in full if k.startswith(prefix)}
        keys = [(m, prefix + z, "column" if s == "down" else names.split_for(s, swiglu), None)
                for m, z, s in names.layer_keys(local, suffixes)]
        # Megatron-core's MoE layer: router, routed experts, then the shared expert
        out += [k for k in keys if ".shared_experts." not in k[0]]
        if prefix + "mlp.experts.weight1" in full:
            for e in range(config.num_experts):
                out += [(m, prefix + z, names.split_for(s, swiglu), e)
                        for m, z, s in names.expert_keys(local, e, suffixes)]
        out += [k for k in keys if ".shared_experts." in k[0]]
    if stage == stages - 1:
        out += [(m, z, s, None) for m, z, s in names.TOP[2:4] if z in full]
        for depth in range(config.mtp_num_layers):  # the MTP depths (megatron_mla.MTP)
            out += [(m, z, "column" if s == "down" else names.split_for(s, swiglu), None)
                    for m, z, s in megatron_mla.mtp_keys(depth, full, names.layer_keys)]
        if not config.tie_word_embeddings:
            out.append(("output_layer.weight", "head_weight", "vocab", None))
        elif stages > 1:  # the last stage's copy of the tied embedding
            out.append(("output_layer.weight", "embedding.word_embeddings.weight", "vocab", None))
    return out


def write(full: FullState, config, root: str, *, tp: int, pp: int, vpp: int = 1,
          iteration: int = 0) -> str:
    """A megazoo FullState as a Megatron-LM legacy checkpoint for (tp, pp, vpp), with the
    optimizer (fp32 masters, Adam moments, step) when `full` holds one. Megatron-LM loads it
    with `--ckpt-format torch --no-load-rng` (no RNG state is written) and, unless the source
    was a Megatron-LM run whose scheduler state is carried, `--override-opt_param-scheduler`."""
    stages = pp * vpp
    if config.num_layers % stages:
        raise ckpt.CheckpointError(f"{config.num_layers} layers do not split over pp={pp} x "
                                   f"vpp={vpp} stages evenly, as Megatron-LM's legacy files need")
    if config.num_query_groups % tp:
        raise ckpt.CheckpointError(f"{config.num_query_groups} query groups do not split over "
                                   f"tp={tp}; Megatron-LM needs whole groups per rank")
    megatron_args.check_exportable(config, root)
    if config.mtp_num_layers and stages > 1:
        raise ckpt.CheckpointError(f"multi-token prediction with pp={pp} x vpp={vpp} stages: "
                                   f"Megatron's last stage also holds an embedding copy for it, "
                                   f"which this export does not write; export at pp=1")
    meta = full.meta
    consumed = int(meta.get("consumed_samples", 0) or 0)
    args = megatron_args.from_config(config, tp=tp, pp=pp, vpp=vpp, iteration=iteration,
                                     consumed_samples=consumed, seq_length=meta.get("seq_length"))
    padded = config.padded_vocab_size(tp)
    weights = {**full.weights, **full.master}
    step = int(full.scalars.get("applied_steps", torch.tensor(iteration)))
    scheduler = scheduler_state((meta.get("source") or {}).get("scheduler"), consumed)
    # Megatron-LM's loader refuses a tracker reading 0: an untrained model is a release
    folder = os.path.join(root, f"iter_{iteration:07d}" if iteration else "release")
    for t in range(tp):
        for p in range(pp):
            def part(values, canon, split, expert):
                tensor = values[canon] if expert is None else values[canon][expert]
                return names.shard(tensor, split, t, tp, padded).clone()
            sd = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                  "opt_param_scheduler": scheduler, "num_floating_point_operations_so_far": 0}
            params, models = [], []
            for v in range(vpp):
                entries = _stage_entries(weights, config, v * pp + p, stages)
                # the expert bias: a buffer, fp32 and outside the optimizer
                models.append({m: part(full.weights, z, s, e).to(
                    torch.float32 if megatron_moe.BUFFERS.fullmatch(m) else config.dtype)
                    for m, z, s, e in entries})
                params += [(m, z, s, e) for m, z, s, e in entries
                           if not megatron_moe.BUFFERS.fullmatch(m)]
            if vpp == 1:
                sd["model"] = models[0]
            else:
                sd.update({f"model{v}": m for v, m in enumerate(models)})
            if full.optim:
                sd["optimizer"] = legacy_optim.state_dict(params, full, config, part, step)
            path = os.path.join(folder, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""),
                                _MODEL_FILES[0])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(sd, path)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration) if iteration else "release")
    logger.info("wrote Megatron-LM checkpoint %s (tp=%d pp=%d vpp=%d, iteration %d%s)", folder,
                tp, pp, vpp, iteration, ", with optimizer" if full.optim else "")
    return folder
