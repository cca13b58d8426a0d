"""Per-tensor checksums of checkpoint rank files: written at save, verified wherever a tensor is read.

Every rank file's safetensors header carries `megazoo.crc32`, a JSON table {tensor name: crc32 of
its raw bytes (8 hex digits)}. Verifying costs one crc32 pass over bytes the reader has already
loaded (about 1 GB/s per core), so resume, rollback, export and `tools/inspect_checkpoint.py
--verify` all check every tensor they read. Files written before megazoo recorded checksums load
with a warning that they were not verified.
"""
from __future__ import annotations

import json
import zlib

import torch

KEY = "megazoo.crc32"
# The fields every reader of a checkpoint's meta.json relies on, and their JSON types.
META_FIELDS = {"iteration": int, "consumed_samples": int, "world_size": int, "model": dict,
               "layout": dict}


def crc32(t: torch.Tensor) -> str:
    """crc32 of a tensor's raw bytes (contiguous, row-major, native byte order)."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.numel() == 0:
        return f"{zlib.crc32(b''):08x}"
    return f"{zlib.crc32(flat.view(torch.uint8).numpy()):08x}"


def header(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors header metadata that records the checksums of `tensors`."""
    return {KEY: json.dumps({k: crc32(v) for k, v in tensors.items()}, sort_keys=True)}


def recorded(metadata: dict | None) -> dict[str, str] | None:
    """The checksum table of a file's header metadata; None for files written without one."""
    if not metadata or KEY not in metadata:
        return None
    try:
        table = json.loads(metadata[KEY])
    except json.JSONDecodeError:
        return {}  # a damaged table: every tensor then fails its check, which names the file
    return table if isinstance(table, dict) else {}


def problem(name: str, t: torch.Tensor, table: dict[str, str] | None) -> str | None:
    """None when tensor `name` matches its recorded checksum (or the file records none)."""
    if table is None:
        return None
    want = table.get(name)
    if want is None:
        return f"tensor {name} has no recorded checksum (the file's header was altered)"
    got = crc32(t)
    if got != want:
        return f"tensor {name} fails its checksum (crc32 {got}, saved {want}): the bytes changed on disk"
    return None


def meta_problem(meta) -> str | None:
    """None when a checkpoint's meta.json holds every field resume, export and inspection read."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    for name, kind in META_FIELDS.items():
        value = meta.get(name)
        if value is None:
            return f"lacks the field {name!r}"
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"field {name!r} is {value!r}, not a JSON {'object' if kind is dict else 'integer'}"
    return None
