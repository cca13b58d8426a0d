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

A ZeRO checkpoint (engine.save_checkpoint's `*_optim_states.pt` per data-parallel rank) is read by
deepspeed_zero.py.
"""
from __future__ import annotations

import logging
import os
import re

import torch

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import (deepspeed_universal_hf, deepspeed_zero,
                                                 megatron_args, safe_load)
from megazoo.training.checkpoint.foreign.assemble import Pieces, check_shapes, expected_shapes
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
_STEP = re.compile(r"global_step(\d+)")
_TRAINER_DIR = re.compile(r"checkpoint-(\d+)")  # the Hugging Face Trainer's save folders
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
    trainer = sorted((n for n in os.listdir(root) if _TRAINER_DIR.fullmatch(n)),
                     key=lambda n: int(n.split("-")[1])) if os.path.isdir(root) else []
    if trainer:
        raise ckpt.CheckpointError(f"{root} is a Hugging Face Trainer output folder holding "
                                   f"{', '.join(trainer)}; pass one of them, e.g. "
                                   f"{os.path.join(root, trainer[-1])}")
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
        return bool(deepspeed_zero.optim_files(folder)) and not _layer_files(folder)
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
        files = deepspeed_zero.optim_files(folder)
        stage = int(deepspeed_zero.value(safe_load.load(files[0])["optimizer_state_dict"]
                                         .get("zero_stage", 0)))
        return (f"DeepSpeed ZeRO-{stage} checkpoint ({os.path.basename(folder)}): {len(files)} "
                f"data-parallel ranks; import with --hf-config"
                + (" (or the Trainer's config.json beside it)"
                   if deepspeed_zero.trainer_config(folder) else ""))
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
    if deepspeed_zero.optim_files(folder) and not _layer_files(folder):
        return deepspeed_zero.read(folder, optimizer, hf_config)
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
