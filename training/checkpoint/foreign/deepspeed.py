"""DeepSpeed checkpoints in: ZeRO-1/2/3, universal checkpoints, and the Megatron-DeepSpeed
pipeline layout BLOOM-176B was saved in.

    ROOT/latest                                   "global_step95000"
    ROOT/global_step95000/mp_rank_TT_model_states.pt    per TP rank: args (an argparse Namespace),
                                                   iteration, DeepSpeed's own records
    ROOT/global_step95000/layer_XX-model_TT-model_states.pt   one pipeline layer's weights
                                                   on TP rank TT

Pipeline layers are numbered in the model's layer list, where parameterless steps (transposes,
casts) take numbers too: the file holding `word_embeddings.weight` is the embedding (with
BLOOM's `word_embeddings.norm`), the files holding `input_layernorm.weight` are the transformer
blocks in order, the last file with a bare `weight` and `bias` is the final norm. Column-parallel
tensors (QKV per head, `dense_h_to_4h`, the padded vocabulary) join along dim 0, row-parallel
weights (`self_attention.dense`, `dense_4h_to_h`) along dim 1; norms and row-parallel biases are
copies on every TP rank and are averaged where they drifted apart (as Hugging Face's BLOOM
converter does), with one line giving the largest drift. The optimizer's ZeRO partitions
(`*_optim_states.pt`) are not read: the import is weights only (train from it with --finetune).

A universal checkpoint (DeepSpeed's ds_to_universal.py output) holds every parameter whole, TP
merged and the vocabulary padding cut: `global_stepN/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`
(each {"param": tensor, ...}) and `step.pt` (the Adam step), next to the model-state files with
the args. Its names are the pipeline module's (`tied_modules.embed.word_embeddings.weight`,
`{layer}.input_layernorm.weight`, `{layer}.weight` for the final norm), mapped as above. It
imports with the fp32 masters and moments, so `--load` continues the run at any layout.

A ZeRO checkpoint, as DeepSpeed's engine.save_checkpoint writes it, has one
`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per data-parallel rank (`bf16_` with bf16
training) and the engine's records (`param_shapes`, steps, samples) in
`mp_rank_00_model_states.pt` (ZeRO-1/2) or in one `zero_pp_rank_R_mp_rank_00_model_states.pt`
per rank (ZeRO-3, whose `module` holds empty placeholders). The optimizer files keep each
parameter group's fp32 masters and Adam moments flat: ZeRO-1/2 split the group's concatenated
parameters over the ranks (`single_partition_of_fp32_groups`, padding removed), ZeRO-3 splits
every parameter into ceil(numel / ranks) pieces (`fp32_flat_groups`). The fp32 masters are
read whatever the training dtype. Its names are the trained module's, so a Hugging Face model's
config.json (`--hf-config`) gives the model and the names; a ZeRO checkpoint records no
configuration of its own (as universal checkpoints under its names: deepspeed_universal_hf.py).
"""
from __future__ import annotations

import logging
import math
import os
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import deepspeed_universal_hf, megatron_args, safe_load
from megazoo.training.checkpoint.foreign.assemble import Pieces, check_shapes, expected_shapes
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
_STEP = re.compile(r"global_step(\d+)")
# Megatron-DeepSpeed block key -> (megazoo suffix, split)
BLOCK = {
    "input_layernorm.weight": ("input_norm.weight", "replicated"),
    "input_layernorm.bias": ("input_norm.bias", "replicated"),
    "self_attention.query_key_value.weight": ("attention.qkv.weight", "column"),
    "self_attention.query_key_value.bias": ("attention.qkv.bias", "column"),
    "self_attention.dense.weight": ("attention.dense.weight", "row"),
    "self_attention.dense.bias": ("attention.dense.bias", "replicated"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "replicated"),
    "post_attention_layernorm.bias": ("post_attention_norm.bias", "replicated"),
    "mlp.dense_h_to_4h.weight": ("mlp.fc1.weight", "column"),
    "mlp.dense_h_to_4h.bias": ("mlp.fc1.bias", "column"),
    "mlp.dense_4h_to_h.weight": ("mlp.fc2.weight", "row"),
    "mlp.dense_4h_to_h.bias": ("mlp.fc2.bias", "replicated"),
}
EMBEDDING = {
    "word_embeddings.weight": ("embedding.word_embeddings.weight", "vocab"),
    "word_embeddings.norm.weight": ("embedding.norm.weight", "replicated"),
    "word_embeddings.norm.bias": ("embedding.norm.bias", "replicated"),
    "position_embeddings.weight": ("embedding.position_embeddings.weight", "replicated"),
}
FINAL = {"weight": ("final_norm.weight", "replicated"), "bias": ("final_norm.bias", "replicated")}


def pipeline_numbers(layers: int) -> tuple[int, int, int]:
    """Megatron-DeepSpeed's GPT pipeline numbers of (the tied embedding, the first block, the
    final norm): its layer list is [fp16 cast, embedding, transpose, blocks..., transpose,
    final norm, tied head, fp32 cast]."""
    return 1, 3, layers + 4


def step_folder(root: str) -> str:
    for tracker in ("latest", "latest_universal"):  # the second written by ds_to_universal.py
        pointer = os.path.join(root, tracker)
        if os.path.isfile(pointer):
            try:
                with open(pointer, encoding="utf-8") as f:
                    return os.path.join(root, f.read().strip())
            except (UnicodeDecodeError, ValueError):  # not DeepSpeed's tag (a garbage file)
                raise ckpt.CheckpointError(f"{pointer} is not a text tag naming a global_step* "
                                           f"folder") from None
    if _STEP.fullmatch(os.path.basename(os.path.normpath(root))):
        return root
    raise ckpt.CheckpointError(f"{root}: no 'latest' file and not a global_step* folder; pass a "
                               f"DeepSpeed --save folder or one of its global_step* folders")


def _layer_files(folder: str) -> dict[int, dict[int, str]]:
    """pipeline layer number -> TP rank -> file."""
    out: dict[int, dict[int, str]] = {}
    for name in sorted(os.listdir(folder)):
        m = _LAYER_FILE.fullmatch(name)
        if m:
            out.setdefault(int(m[1]), {})[int(m[2])] = os.path.join(folder, name)
    return out


def is_pipeline_layout(root: str) -> bool:
    try:
        return bool(_layer_files(step_folder(root)))
    except (ckpt.CheckpointError, OSError):
        return False


def is_zero(root: str) -> bool:
    try:
        folder = step_folder(root)
        return bool(_optim_files(folder)) and not _layer_files(folder)
    except (ckpt.CheckpointError, OSError):
        return False


def is_universal(root: str) -> bool:
    try:
        return os.path.isdir(os.path.join(step_folder(root), "zero"))
    except (ckpt.CheckpointError, OSError):
        return False


def _args(folder: str):
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise ckpt.CheckpointError(f"{path} is missing: it records the model's args, without "
                                   f"which the layer files cannot be read")
    return safe_load.load(path)


def describe(root: str) -> str:
    folder = step_folder(root)
    if os.path.isdir(os.path.join(folder, "zero")):
        count = sum(os.path.isdir(os.path.join(folder, "zero", n))
                    for n in os.listdir(os.path.join(folder, "zero")))
        return (f"DeepSpeed universal checkpoint ({os.path.basename(folder)}): {count} parameters "
                f"with fp32 masters and Adam moments")
    if is_zero(root):
        osd = safe_load.load(_optim_files(folder)[0])["optimizer_state_dict"]
        return (f"DeepSpeed ZeRO-{int(_value(osd.get('zero_stage', 0)))} checkpoint "
                f"({os.path.basename(folder)}): {len(_optim_files(folder))} data-parallel ranks; "
                f"import with --hf-config")
    files = _layer_files(folder)
    tp = max(len(v) for v in files.values())
    args = _args(folder).get("args")
    return (f"DeepSpeed pipeline-layer checkpoint (Megatron-DeepSpeed, {os.path.basename(folder)}): "
            f"{len(files)} layer files x tp={tp}, {args.num_layers} transformer layers, hidden "
            f"{args.hidden_size}")


def read(root: str, vocab_size: int | None = None, *, optimizer: bool = True,
         hf_config: str | None = None):
    """(family, config, FullState, iteration) of a universal or ZeRO checkpoint (with the
    optimizer) or of the pipeline layout (weights only)."""
    folder = step_folder(root)
    if os.path.isdir(os.path.join(folder, "zero")):
        if deepspeed_universal_hf.is_hf_named(os.path.join(folder, "zero")):
            return deepspeed_universal_hf.read(folder, optimizer, hf_config)
        return _read_universal(folder, vocab_size, optimizer)
    if _optim_files(folder) and not _layer_files(folder):
        return _read_zero(folder, optimizer, hf_config)
    states = _args(folder)
    args = states.get("args")
    family, config = megatron_args.to_config(args, folder, vocab_size)
    files = _layer_files(folder)
    tp = args.tensor_model_parallel_size
    pieces, block = Pieces(folder), 0
    for number in sorted(files):
        by_rank = files[number]
        if sorted(by_rank) != list(range(tp)):
            raise ckpt.CheckpointError(f"{folder}: layer {number:02d} has files for TP ranks "
                                       f"{sorted(by_rank)}, the recorded tp={tp} calls for all")
        is_block = False
        for t, path in sorted(by_rank.items()):
            sd = safe_load.load(path)
            is_block = "input_layernorm.weight" in sd
            if is_block:
                table, prefix = BLOCK, f"layers.{block}."
            elif "word_embeddings.weight" in sd:
                table, prefix = EMBEDDING, ""
            elif set(sd) <= set(FINAL):
                table, prefix = FINAL, ""
            else:
                raise ckpt.CheckpointError(f"{path}: holds {sorted(sd)[:4]}, not a BLOOM/GPT "
                                           f"pipeline layer megazoo maps")
            for key, tensor in sd.items():
                if key not in table:
                    raise ckpt.CheckpointError(f"{path}: {key} is not a tensor megazoo maps")
                name, split = table[key]
                pieces.add(prefix + name, split, None, t, tensor, copy=number)
        block += is_block
    if block != config.num_layers:
        raise ckpt.CheckpointError(f"{folder}: {block} transformer layer files, the recorded args "
                                   f"say num_layers={config.num_layers}")
    weights = pieces.full(tp, config.vocab_size)
    check_shapes(weights, expected_shapes(family, config), folder,
                 f"its args (hidden_size={args.hidden_size}, num_attention_heads="
                 f"{args.num_attention_heads}, padded_vocab_size={args.padded_vocab_size})")
    iteration = int(states.get("iteration") or _STEP.fullmatch(os.path.basename(folder))[1])
    if optimizer:
        logger.warning("%s: DeepSpeed's ZeRO optimizer partitions are not read; the import holds "
                       "the weights only (train from it with --finetune)", folder)
    meta = dict(consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                skipped_steps=0, seq_length=getattr(args, "seq_length", None),
                source=dict(format="deepspeed", folder=os.path.abspath(folder)))
    return family, config, FullState(meta, {k: v.float() for k, v in weights.items()}), iteration


_UNIVERSAL_STATES = {"master": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}


def _universal_names(names: list[str], folder: str) -> dict[str, str]:
    """Pipeline-module parameter name -> megazoo canonical name."""
    blocks = sorted({int(n.split(".", 1)[0]) for n in names
                     if n.split(".", 1)[0].isdigit() and n.split(".", 1)[1] in BLOCK})
    out = {}
    for n in names:
        head, _, rest = n.partition(".")
        if n.startswith("tied_modules.embed.") and n[len("tied_modules.embed."):] in EMBEDDING:
            out[n] = EMBEDDING[n[len("tied_modules.embed."):]][0]
        elif head.isdigit() and rest in BLOCK:
            out[n] = f"layers.{blocks.index(int(head))}.{BLOCK[rest][0]}"
        elif head.isdigit() and rest in FINAL:
            out[n] = FINAL[rest][0]
        else:
            raise ckpt.CheckpointError(f"{folder}/zero/{n}: not a Megatron-DeepSpeed pipeline "
                                       f"parameter megazoo maps (GPT, BLOOM)")
    return out


def _read_universal(folder: str, vocab_size: int | None, optimizer: bool):
    states = _args(folder)
    args = states.get("args")
    family, config = megatron_args.to_config(args, folder, vocab_size)
    zero = os.path.join(folder, "zero")
    params = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    canonical = _universal_names(params, folder)
    wanted = _UNIVERSAL_STATES if optimizer else {"master": "fp32.pt"}
    full = {s: {} for s in wanted}
    steps = set()
    for name in params:
        for state, file in wanted.items():
            path = os.path.join(zero, name, file)
            if not os.path.isfile(path):
                raise ckpt.CheckpointError(f"{path} is missing; the universal checkpoint is "
                                           f"incomplete (or import with --no-optimizer)")
            record = safe_load.load(path)
            tensor = record.get("param") if isinstance(record, dict) else None
            if tensor is None:
                raise ckpt.CheckpointError(f"{path}: holds no 'param' tensor")
            if canonical[name] == "embedding.word_embeddings.weight":
                tensor = tensor[:config.vocab_size]
            full[state][canonical[name]] = tensor.float()
        step = os.path.join(zero, name, "step.pt")
        if optimizer and os.path.isfile(step):
            steps.add(int(safe_load.load(step)))
    expected = expected_shapes(family, config)
    recorded = (f"its args (hidden_size={args.hidden_size}, num_attention_heads="
                f"{args.num_attention_heads}, padded_vocab_size={args.padded_vocab_size})")
    for state in full.values():
        check_shapes(state, expected, folder, recorded)
    iteration = int(states.get("iteration") or _STEP.fullmatch(os.path.basename(folder))[1])
    step = max(steps) if steps else iteration
    optim = full if optimizer else {}
    scalars = {"iteration": torch.tensor(iteration), "applied_steps": torch.tensor(step)} \
        if optimizer else {}
    meta = dict(consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                skipped_steps=max(iteration - step, 0), seq_length=getattr(args, "seq_length", None),
                source=dict(format="deepspeed-universal", folder=os.path.abspath(folder)))
    return family, config, FullState(meta, dict(full["master"]), optim, scalars), iteration


_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def _optim_files(folder: str) -> list[str]:
    found = []
    for name in os.listdir(folder):
        m = _OPTIM_FILE.fullmatch(name)
        if m:
            if int(m[2]) != 0:
                raise ckpt.CheckpointError(f"{folder}: {name} is a model-parallel rank's ZeRO "
                                           f"state; convert it with ds_to_universal.py first")
            found.append((int(m[1]), os.path.join(folder, name)))
    return [p for _, p in sorted(found)]


def _zero_model_states(folder: str) -> str:
    """The engine's records (param_shapes, steps, samples): ZeRO-1/2's one file, or rank 0's of
    ZeRO-3's per-rank files (the same records on every rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise ckpt.CheckpointError(f"{folder}: neither mp_rank_00_model_states.pt (ZeRO-1/2) nor "
                               f"zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3) is there; "
                               f"copy the model-state files with the optimizer's")


def _value(v):
    return getattr(v, "value", v)


def _group_states(osd: dict, stage: int, groups: int) -> list[dict]:
    """Per parameter group, this rank's flat Adam state ({exp_avg, exp_avg_sq, step})."""
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    if isinstance(base, list):  # ZeRO-1/2's elastic form: one lean state per group
        return base
    state = (base or {}).get("state", {})
    return [state.get(g, {}) for g in range(groups)]


def _unflatten_zero12(flats: list[torch.Tensor], shapes, paddings, where: str) -> dict:
    out = {}
    for g, (names, flat) in enumerate(zip(shapes, flats)):
        offset = 0
        for j, (name, shape) in enumerate(names.items()):
            n = math.prod(shape)
            if offset + n > flat.numel():
                raise ckpt.CheckpointError(f"{where}: group {g} holds {flat.numel()} elements, "
                                           f"its param_shapes need more; the files disagree")
            out[name] = flat[offset:offset + n].view(tuple(shape))
            offset += n + (paddings[g][j] if paddings else 0)
    return out


def _unflatten_zero3(per_rank: list[torch.Tensor], shapes, where: str) -> dict:
    world, out, offset = len(per_rank), {}, 0
    for name, shape in ((k, v) for names in shapes for k, v in names.items()):
        n = math.prod(shape)
        part = -(-n // world)
        full = torch.cat([flat[offset:offset + part] for flat in per_rank])
        if full.numel() < n:
            raise ckpt.CheckpointError(f"{where}: the ranks' fp32_flat_groups end before {name}")
        out[name] = full[:n].view(tuple(shape))
        offset += part
    return out


def _read_zero(folder: str, optimizer: bool, hf_config: str | None):
    if not hf_config:
        raise ckpt.CheckpointError(f"{folder}: a DeepSpeed ZeRO checkpoint records no model "
                                   f"configuration; pass --hf-config with the model's "
                                   f"config.json folder")
    from megazoo.training.checkpoint.hf import read_hf_config
    model_type, module, hf = read_hf_config(hf_config)
    config = module.config_from_hf(hf)
    path = _zero_model_states(folder)
    states = safe_load.load(path)
    shapes = states.get("param_shapes")
    if not shapes:
        raise ckpt.CheckpointError(f"{path} records no param_shapes; it is not a ZeRO checkpoint")
    shapes = shapes if isinstance(shapes, list) else [shapes]
    osds = [safe_load.load(p)["optimizer_state_dict"] for p in _optim_files(folder)]
    stage = int(_value(osds[0].get("zero_stage", 0)))
    count = osds[0].get("partition_count")
    world = max(count) if isinstance(count, list) else int(count or len(osds))
    if world != len(osds):
        raise ckpt.CheckpointError(f"{folder}: {len(osds)} *_optim_states.pt files, the ZeRO "
                                   f"partition count is {world}; copy every rank's file")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = len(osds[0][key])
    per_state = {"master": [o[key] for o in osds]}
    if optimizer:
        for s in ("exp_avg", "exp_avg_sq"):
            per_state[s] = [[st[s] for st in _group_states(o, stage, groups)] for o in osds]
    full = {}
    for state, ranks in per_state.items():
        if stage == 3:
            flat = _unflatten_zero3([torch.cat(list(r)) for r in ranks], shapes, folder)
        else:
            merged = [torch.cat([r[g] for r in ranks]) for g in range(groups)]
            flat = _unflatten_zero12(merged, shapes, osds[0].get("param_alignment_paddings"), folder)
        try:
            full[state] = {k: v.float() for k, v in module.from_hf_state_dict(flat, config).items()}
        except KeyError as e:
            raise ckpt.CheckpointError(f"{folder}: the parameters lack {e}; they do not match "
                                       f"{hf_config}/config.json ({model_type})") from None
    steps = {int(st["step"]) for o in osds for st in _group_states(o, stage, groups) if "step" in st}
    iteration = int(states.get("global_steps") or _STEP.fullmatch(os.path.basename(folder))[1])
    step = max(steps) if steps else iteration
    meta = dict(consumed_samples=int(states.get("global_samples") or 0),
                skipped_steps=int(states.get("skipped_steps") or 0),
                source=dict(format=f"deepspeed-zero{stage}", folder=os.path.abspath(folder)))
    optim = full if optimizer else {}
    scalars = {"iteration": torch.tensor(iteration), "applied_steps": torch.tensor(step)} \
        if optimizer else {}
    return model_type, config, FullState(meta, dict(full["master"]), optim, scalars), iteration
