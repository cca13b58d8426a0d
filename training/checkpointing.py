"""Atomic, sharded checkpoints in safetensors (nothing is unpickled on load).

Layout of `--save DIR`:

    DIR/latest                      "iter_0000200" (written last, by rename)
    DIR/iter_0000200/meta.json      iteration, data position, layout, model config, file list
    DIR/iter_0000200/rank_00003.safetensors   this rank's model shards, optimizer shards, RNG

Every rank writes into `iter_N.tmp/`; after a barrier rank 0 writes meta.json, renames the folder
to `iter_N`, then replaces `latest`. A crash at any point leaves `latest` naming the previous
complete checkpoint; a stale `.tmp` folder is ignored and cleared by the next save.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsync_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank:05d}.safetensors")


def save_checkpoint(root: str, iteration: int, rank: int, world_size: int,
                    tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Collective: every rank passes its own tensors; rank 0's `meta` is recorded."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if rank == 0:
        _prepare(root, tmp)
    _barrier()
    write_rank_file(tmp, rank, tensors)
    _barrier()
    if rank == 0:
        commit(root, iteration, world_size, meta)
    _barrier()
    return final


def _prepare(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    os.makedirs(tmp)


def begin_offline(root: str, iteration: int) -> str:
    """Start a checkpoint written by one process for every rank (conversion tools); returns
    the temporary folder to pass to `write_rank_file`, then call `commit`."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    _prepare(root, tmp)
    return tmp


def honour_umask(path: str) -> None:
    """safetensors creates its files 0600; give them the mode open() would (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_rank_file(tmp: str, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    path = rank_file(tmp, rank)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
    honour_umask(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def commit(root: str, iteration: int, world_size: int, meta: dict) -> str:
    """Write meta.json, move the complete folder into place, then point `latest` at it."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    meta = dict(meta, iteration=iteration, world_size=world_size,
                files=[os.path.basename(rank_file(tmp, r)) for r in range(world_size)])
    _fsync_write(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, default=_jsonable))
    if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): move the old aside
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    _fsync_write(os.path.join(root, "latest"), os.path.basename(final))
    shutil.rmtree(final + ".old", ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    return final


def _jsonable(obj):
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    return str(obj)


def json_tensor(obj) -> torch.Tensor:
    """JSON as a uint8 tensor: per-file descriptions travel inside the safetensors file."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor):
    return json.loads(bytes(t.numpy().tobytes()).decode())


def latest_checkpoint(root: str) -> str | None:
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    folder = os.path.join(root, name)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{pointer} names {name}, which does not exist; point it at a "
                              f"complete iter_* folder")
    return folder


def resolve(path: str) -> str:
    """A checkpoint folder from a --save/--load root (through `latest`) or an iter_* folder."""
    folder = latest_checkpoint(path) if os.path.exists(os.path.join(path, "latest")) else path
    if folder is None or not os.path.isfile(os.path.join(folder, "meta.json")):
        raise CheckpointError(f"{path}: no checkpoint here ('latest' or meta.json); pass the "
                              f"--save folder of a training run or of tools/convert_hf.py import")
    return folder


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({e}); the checkpoint is "
                              f"incomplete, use an earlier one") from None


def load_rank_tensors(folder: str, rank: int) -> dict[str, torch.Tensor]:
    path = rank_file(folder, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was written by fewer ranks or is "
                              f"incomplete")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated shard ({e}); use an earlier "
                              f"checkpoint") from None


def open_rank_file(folder: str, rank: int):
    """A lazy reader (`safetensors.safe_open`) of one rank's file, with clear errors."""
    path = rank_file(folder, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was written by fewer ranks or is "
                              f"incomplete")
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated shard ({e}); use an earlier "
                              f"checkpoint") from None


def check_compatible(meta: dict, *, model: dict, folder: str) -> None:
    """Refuse checkpoints of another model, naming the difference (a layout may differ:
    `training/reshard.py` maps any layout onto any other)."""
    saved_model = meta.get("model", {})
    diffs = [k for k in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                         "ffn_hidden_size", "position_embedding", "embedding_layernorm",
                         "num_query_groups", "normalization", "activation", "rope_theta",
                         "rope_scaling", "tie_word_embeddings", "bias", "kv_channels", "add_qkv_bias",
                         "qk_layernorm", "scale_attn_weights", "scale_attn_by_inverse_layer_idx")
             if k in saved_model and saved_model.get(k) != model.get(k)]
    if diffs:
        k = diffs[0]
        raise CheckpointError(f"{folder} holds another model: {k}={saved_model.get(k)!r} there, "
                              f"{model.get(k)!r} here; pass matching model flags or another --load")
