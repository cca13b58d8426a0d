"""torchtitan's checkpoints in and out (`--format torchtitan`): Llama 3 and Qwen3 (dense).

torchtitan's CheckpointManager writes one torch.distributed.checkpoint (DCP) folder per save:

    <dump_folder>/checkpoint/step-N/.metadata      the index of every entry
    <dump_folder>/checkpoint/step-N/__R_S.distcp   the bytes (whole tensors, whatever the layout)

with the model's parameters at the top level under torchtitan's own names (`tok_embeddings.weight`,
`layers.{i}.attention.wq.weight`, `layers.{i}.feed_forward.w1.weight`, `norm.weight`,
`output.weight`) and, in an interval save, `optimizer.state.<name>.{exp_avg,exp_avg_sq,step}`
(the flattened per-parameter Adam state), `optimizer.param_groups.<name>.*`, `lr_scheduler.*`,
`dataloader.*` and `train_state.{step,ntokens_seen}`. The last save may be model-only
(`last_save_model_only`), in `export_dtype`. Nothing records the model's configuration, so the
Hugging Face config.json of the model (`--hf-config`; torchtitan's `model.hf_assets_path` holds
it) gives the shapes and the family: model_type llama is torchtitan's llama3, qwen3 its qwen3.

Names map through the Hugging Face names (each family's adapter does the rest). torchtitan's
llama3 rotates (even, odd) channel pairs of each head as complex numbers, Hugging Face's Llama
(and megazoo) the two halves of the head: the rows of wq and wk (and of their Adam moments) are
reordered per head from pairs to halves on the way in, and back on the way out. Qwen3 in
torchtitan rotates halves already. An import carries the weights (the fp32 masters when an
optimizer is there), Adam's moments and step and the iteration (`train_state.step`); the LR
schedule, the optimizer's hyperparameters (logged) and the dataloader's position are not.
Only torch AdamW state continues (torchtitan's `Adam` with weight decay, amsgrad or maximize are
refused, as hf_trainer_optim.check_adam refuses them); a decay is said once (torchtitan decays
every parameter, megazoo matrices only). From a checkpoint folder the newest step-N holding
.metadata is read (others skipped, logged), as torchtitan's loader picks it; an HF save newest is
refused (`--format hf`). llama3's config.json must give torchtitan's RoPE scaling (refused
otherwise). Export writes a model-only `step-N/` folder (fp32), as `last_save_model_only` does,
into `step-N.tmp/` then renamed, never over an existing save; torchtitan loads it with
`checkpoint.initial_load_path` (model-only, the default for it).
`.metadata` is unpickled through an allowlist (DCP's metadata classes, paths, sizes, dtypes;
safe_load.dcp_metadata), other entries with weights_only=True: reading runs no saved code.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import hf_trainer_optim, safe_load
from megazoo.training.checkpoint.foreign.assemble import expected_shapes
from megazoo.training.checkpoint.reshard import FullState

logger = logging.getLogger(__name__)

# torchtitan name -> Hugging Face name (LlamaForCausalLM / Qwen3ForCausalLM)
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
LAYER = {"attention.wq.weight": "self_attn.q_proj.weight",
         "attention.wk.weight": "self_attn.k_proj.weight",
         "attention.wv.weight": "self_attn.v_proj.weight",
         "attention.wo.weight": "self_attn.o_proj.weight",
         "attention.q_norm.weight": "self_attn.q_norm.weight",
         "attention.k_norm.weight": "self_attn.k_norm.weight",
         "feed_forward.w1.weight": "mlp.gate_proj.weight",
         "feed_forward.w3.weight": "mlp.up_proj.weight",
         "feed_forward.w2.weight": "mlp.down_proj.weight",
         "attention_norm.weight": "input_layernorm.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight"}
# Hugging Face model_type -> (torchtitan model, whether its RoPE rotates interleaved pairs)
MODELS = {"llama": ("llama3", True), "qwen3": ("qwen3", False)}
# torchtitan 0.2's llama3 scales RoPE as Llama 3.1 does, with its RoPEScalingArgs defaults
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
OPTIM = ("exp_avg", "exp_avg_sq")
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_STEP_DIR = re.compile(r"step-(\d+)")
_HYPER = ("lr", "betas", "eps", "weight_decay")
_GROUP = _HYPER + ("amsgrad", "maximize", "decoupled_weight_decay")
HF_INDEX = "model.safetensors.index.json"


def to_hf_name(key: str) -> str | None:
    if key in TOP:
        return TOP[key]
    m = _LAYER_KEY.fullmatch(key)
    return f"model.layers.{m[1]}.{LAYER[m[2]]}" if m and m[2] in LAYER else None


_FROM_HF_TOP = {v: k for k, v in TOP.items()}
_FROM_HF_LAYER = {v: k for k, v in LAYER.items()}
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def from_hf_name(key: str) -> str | None:
    if key in _FROM_HF_TOP:
        return _FROM_HF_TOP[key]
    m = _HF_LAYER_KEY.fullmatch(key)
    return f"layers.{m[1]}.{_FROM_HF_LAYER[m[2]]}" if m and m[2] in _FROM_HF_LAYER else None


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from (re, im) pairs [r0, i0, r1, i1, ...] to halves [r0, r1, ...,
    i0, i1, ...]: torchtitan llama3's wq / wk row order to Hugging Face's."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads(key: str, config) -> int | None:
    """How many heads a wq / wk tensor holds (None for every other tensor)."""
    if key.endswith("attention.wq.weight"):
        return config.num_attention_heads
    if key.endswith("attention.wk.weight"):
        return config.num_query_groups or config.num_attention_heads
    return None


def to_hf(sd: dict, config, interleaved: bool) -> dict:
    """torchtitan-named tensors -> Hugging Face-named ones (wq / wk rows reordered when the
    model rotates interleaved pairs)."""
    out = {}
    for key, t in sd.items():
        heads = _heads(key, config)
        out[to_hf_name(key)] = pairs_to_halves(t, heads) if interleaved and heads else t
    return out


def from_hf(sd: dict, config, interleaved: bool) -> dict:
    out = {}
    for key, t in sd.items():
        name = from_hf_name(key)
        heads = _heads(name, config)
        out[name] = halves_to_pairs(t, heads) if interleaved and heads else t
    return out


def step_folder(root: str) -> str:
    """A step-N folder (its .metadata), or the newest step-N holding .metadata in a torchtitan
    checkpoint folder (or in a dump folder's checkpoint/), as torchtitan's own loader picks it;
    an HF save (`model.safetensors.index.json`) newest is refused, naming it."""
    if os.path.isfile(os.path.join(root, ".metadata")):
        return root
    if os.path.isfile(os.path.join(root, HF_INDEX)):
        raise ckpt.CheckpointError(f"{root}: torchtitan's Hugging Face save ({HF_INDEX}); "
                                   f"import it with --format hf")
    for base in (root, os.path.join(root, "checkpoint")):
        steps = sorted((int(m[1]), m[0]) for m in map(_STEP_DIR.fullmatch, os.listdir(base))
                       if m) if os.path.isdir(base) else []
        for _, name in reversed(steps):
            folder = os.path.join(base, name)
            if os.path.isfile(os.path.join(folder, ".metadata")):
                logger.info("%s: reading the newest torchtitan save, %s", root, folder)
                return folder
            if os.path.isfile(os.path.join(folder, HF_INDEX)):
                raise ckpt.CheckpointError(f"{folder}: the newest save is torchtitan's Hugging "
                                           f"Face save ({HF_INDEX}); import it with --format hf, "
                                           f"or pass an older step-N folder")
            logger.warning("%s: no .metadata (an unfinished or foreign save); skipped", folder)
    raise ckpt.CheckpointError(f"{root}: neither a torchtitan step-N folder (with .metadata) nor "
                               f"a checkpoint folder holding step-N folders; pass one")


def is_torchtitan(root: str) -> bool:
    try:
        metadata = safe_load.dcp_metadata(step_folder(root)).state_dict_metadata
    except (ckpt.CheckpointError, OSError, ValueError, RuntimeError):
        return False
    return "tok_embeddings.weight" in metadata


def describe(root: str) -> str:
    folder = step_folder(root)
    metadata = safe_load.dcp_metadata(folder).state_dict_metadata
    layers = {m[1] for m in map(_LAYER_KEY.fullmatch, metadata) if m}
    optim = any(k.startswith("optimizer.state.") for k in metadata)
    dtype = metadata["tok_embeddings.weight"].properties.dtype
    return (f"torchtitan checkpoint ({os.path.basename(os.path.normpath(folder))}): {len(layers)} "
            f"layers, {str(dtype).removeprefix('torch.')} weights, "
            + ("with optimizer state" if optim else "model-only")
            + "; it records no model configuration (import with --hf-config)")


def _read(folder: str, metadata: dict, keys: list[str]) -> dict:
    """The entries `keys` of a DCP folder: tensors in their saved dtype, other entries as plain
    data (refused if they would run code)."""
    wanted = {k: (torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype)
                  if isinstance(metadata[k], TensorStorageMetadata) else io.BytesIO())
              for k in keys}
    try:
        with warnings.catch_warnings():  # DCP warns that no process group is up: none is needed
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, storage_reader=safe_load.SafeDCPReader(folder), no_dist=True,
                     planner=safe_load.SafeBytesPlanner())
    except Exception as e:  # DCP wraps each read's failure in its own exception type
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ckpt.CheckpointError(f"{folder}: unreadable DCP entries ({first}); the checkpoint "
                                   f"is damaged or incomplete") from None
    return wanted


def _expected(config, module, where: str) -> dict[str, tuple]:
    """torchtitan name -> shape of every tensor the configuration calls for."""
    meta = {k: torch.empty(s, device="meta")
            for k, s in expected_shapes(config.family, config).items()}
    out = {}
    for hf_name, t in module.to_hf_state_dict(meta, config).items():
        name = from_hf_name(hf_name)
        if name is None:
            raise ckpt.CheckpointError(f"{where}: {hf_name} has no torchtitan name (torchtitan's "
                                       f"{MODELS[config.family][0]} has no such tensor)")
        out[name] = tuple(t.shape)
    return out


def _check_model(config, where: str) -> tuple[str, bool]:
    if config.family not in MODELS:
        raise ckpt.CheckpointError(f"{where}: model_type {config.family!r}; megazoo maps "
                                   f"torchtitan's {sorted(MODELS)} models (its llama3 and qwen3)")
    if config.num_experts:
        raise ckpt.CheckpointError(f"{where}: a mixture-of-experts model; megazoo maps "
                                   f"torchtitan's dense llama3 and qwen3 only")
    name, interleaved = MODELS[config.family]
    if name == "llama3":
        if config.kv_channels not in (None, config.hidden_size // config.num_attention_heads):
            raise ckpt.CheckpointError(f"{where}: head_dim {config.kv_channels}; torchtitan's "
                                       f"llama3 has hidden_size / num_attention_heads")
        scaling = config.rope_scaling or {}
        if {k: scaling.get(k) for k in LLAMA3_ROPE} != LLAMA3_ROPE:
            raise ckpt.CheckpointError(
                f"{where}: rope_scaling {config.rope_scaling}; torchtitan 0.2's llama3 applies "
                f"Llama 3.1's scaling to every model (RoPEScalingArgs): put \"rope_parameters\": "
                f"{json.dumps({**LLAMA3_ROPE, 'rope_theta': config.rope_theta})} in config.json")
    return name, interleaved


def _check_adam(folder: str, metadata: dict, got: dict, first: str, name: str) -> None:
    """torchtitan's one parameter group (its first parameter's fields) and state keys as a torch
    optimizer state_dict, checked as the Trainer's is: Adam with L2 decay, amsgrad, maximize and
    other optimizers refused. Its decay (if any) covers every parameter: said once."""
    state = f"optimizer.state.{name}."
    group = {h: got[first + h] for h in _GROUP if first + h in got}
    osd = {"state": {0: {k[len(state):]: None for k in metadata if k.startswith(state)}},
           "param_groups": [group]}
    hf_trainer_optim.check_adam(osd, folder, "torchtitan's optimizer.name AdamW")
    if group.get("weight_decay"):
        logger.warning("%s: torchtitan decayed every parameter by %g (norms too, one group); "
                       "megazoo decays matrices only (not norms nor other vectors)", folder,
                       group["weight_decay"])


def read(root: str, vocab_size: int | None = None, *, optimizer: bool = True,
         hf_config: str | None = None):
    """(family, config, FullState, iteration) of a torchtitan step-N folder."""
    folder = step_folder(root)
    if vocab_size is not None:
        raise ckpt.CheckpointError("--vocab-size: the vocabulary is config.json's (--hf-config); "
                                   "drop the flag")
    if not hf_config:
        raise ckpt.CheckpointError(f"{folder}: a torchtitan checkpoint records no model "
                                   f"configuration; pass --hf-config with the model's config.json "
                                   f"folder (torchtitan's model.hf_assets_path)")
    from megazoo.training.checkpoint.hf import read_hf_config
    model_type, module, hf = read_hf_config(hf_config)
    config = module.config_from_hf(hf)
    where = f"{folder} with {hf_config}/config.json"
    _, interleaved = _check_model(config, where)
    metadata = safe_load.dcp_metadata(folder).state_dict_metadata
    expected = _expected(config, module, where)
    tied_copy = config.tie_word_embeddings and "output.weight" in metadata
    model_keys = {k for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)
                  and not k.startswith(("optimizer.", "lr_scheduler.", "dataloader."))}
    extra = sorted(model_keys - set(expected) - ({"output.weight"} if tied_copy else set()))
    missing = sorted(set(expected) - model_keys)
    if extra:
        raise ckpt.CheckpointError(f"{where}: the checkpoint holds {extra[:3]} that config.json "
                                   f"does not call for (and lacks {missing[:3]}); they disagree")
    if missing:
        raise ckpt.CheckpointError(f"{where}: the checkpoint lacks {missing[:3]} that config.json "
                                   f"calls for; they disagree")
    for key, shape in expected.items():
        if tuple(metadata[key].size) != shape:
            raise ckpt.CheckpointError(f"{where}: {key} has shape {tuple(metadata[key].size)}, "
                                       f"config.json gives {shape}; the checkpoint and config.json "
                                       f"disagree")
    states = {s: [f"optimizer.state.{k}.{s}" for k in expected] for s in OPTIM}
    has_optim = all(k in metadata for keys in states.values() for k in keys)
    if optimizer and not has_optim:
        logger.info("%s holds no optimizer state (a model-only save); importing the weights only",
                    folder)
    optimizer = optimizer and has_optim
    keys = sorted(expected) + (["output.weight"] if tied_copy else [])
    if optimizer:
        keys += [k for s in OPTIM for k in states[s]]
        keys += [f"optimizer.state.{k}.step" for k in expected if
                 f"optimizer.state.{k}.step" in metadata]
    keys += [k for k in ("train_state.step", "train_state.ntokens_seen") if k in metadata]
    first = f"optimizer.param_groups.{next(iter(expected))}."
    keys += [first + h for h in _GROUP if optimizer and first + h in metadata]
    got = _read(folder, metadata, keys)
    if optimizer:
        _check_adam(folder, metadata, got, first, next(iter(expected)))
    if tied_copy and not torch.equal(got.pop("output.weight"), got["tok_embeddings.weight"]):
        raise ckpt.CheckpointError(f"{where}: config.json ties the embeddings but output.weight "
                                   f"differs from tok_embeddings.weight; set tie_word_embeddings "
                                   f"false in config.json")
    full = {}
    for state in ("weights",) + (OPTIM if optimizer else ()):
        suffix = "" if state == "weights" else f".{state}"
        prefix = "" if state == "weights" else "optimizer.state."
        sd = {k: got[prefix + k + suffix] for k in expected}
        full[state] = {k: v.float() for k, v in
                       module.from_hf_state_dict(to_hf(sd, config, interleaved), config).items()}
    named = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(folder)))
    iteration = int(got.get("train_state.step", int(named[1]) if named else 0))
    steps = {int(v) for k, v in got.items() if k.endswith(".step") and k.startswith("optimizer.")}
    if optimizer:
        logger.info("%s: carried Adam's moments and step %s and iteration %d; not carried: the LR "
                    "schedule (lr_scheduler.*), the data position (dataloader.*, %s tokens seen) "
                    "and the optimizer's settings (%s): give megazoo's flags to match", folder,
                    max(steps) if steps else iteration, iteration,
                    got.get("train_state.ntokens_seen", "?"),
                    ", ".join(f"{h} {got[first + h]}" for h in _HYPER if first + h in got))
    step = max(steps) if steps else iteration
    meta = dict(consumed_samples=0, skipped_steps=max(iteration - step, 0),
                source=dict(format="torchtitan", folder=os.path.abspath(folder)))
    optim = {"master": full["weights"], **{s: full[s] for s in OPTIM}} if optimizer else {}
    scalars = {"iteration": torch.tensor(iteration), "applied_steps": torch.tensor(step)} \
        if optimizer else {}
    return model_type, config, FullState(meta, full["weights"], optim, scalars), iteration


def check_layout(tp: int, pp: int, vpp: int) -> None:
    """An export takes no layout: refused before the checkpoint is read."""
    if (tp, pp, vpp) != (1, 1, 1):
        raise ckpt.CheckpointError("--format torchtitan: DCP holds whole tensors (torchtitan "
                                   "shards them as it loads); drop the layout flags")


def write(full: FullState, config, root: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
          iteration: int = 0) -> str:
    """A megazoo FullState as torchtitan's model-only save, `root/step-<iteration>/` (fp32)."""
    check_layout(tp, pp, vpp)
    from megazoo.models.registry import family
    where = f"{root} (a {config.family} model)"
    _, interleaved = _check_model(config, where)
    module = family(config.family, where).adapter
    hf = module.to_hf_state_dict({**full.weights, **full.master}, config)
    unmapped = sorted(k for k in hf if from_hf_name(k) is None)
    if unmapped:
        raise ckpt.CheckpointError(f"{where}: {unmapped[:3]} have no torchtitan name; torchtitan's "
                                   f"{MODELS[config.family][0]} has no such tensors")
    sd = {k: v.detach().float().contiguous() for k, v in from_hf(hf, config, interleaved).items()}
    if "output.weight" not in sd:  # tied: torchtitan's model keeps both names
        sd["output.weight"] = sd["tok_embeddings.weight"].clone()
    folder = os.path.join(root, f"step-{iteration}")
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise ckpt.CheckpointError(f"{folder} exists (a torchtitan save is not overwritten); "
                                   f"pass another --save or move it away")
    tmp = folder + ".tmp"  # written whole, then renamed: no half-written step-N
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier export
    os.makedirs(tmp)
    with warnings.catch_warnings():  # DCP warns that no process group is up: none is needed
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    if os.path.isdir(folder):
        os.rmdir(folder)  # empty
    os.rename(tmp, folder)
    logger.info("exported %d tensors to %s (torchtitan's model-only save; load it with "
                "--checkpoint.initial_load_path %s)", len(sd), folder, folder)
    return folder
