"""Enumerate preprocessing inputs as small records, lazily, so memory never grows with the corpus.

A record is ``(kind, source, line, payload)``:
- ``"json"``: one raw line of a jsonl file (plain or .gz) as bytes; parsed in the worker.
- ``"file"``: a path to a text file that is one document; read in the worker.
- ``"row"``: a dict row from a local parquet/csv/arrow file read through HF ``datasets``.
Validation (JSON, keys, UTF-8) happens in the workers so the main process only moves bytes.
"""
from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterator

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
DEFAULT_TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
# Directory names skipped when walking a folder: caches, VCS folders and installed third-party
# packages (the standard library folder contains site-packages, which is not its own text).
DEFAULT_EXCLUDES = ("__pycache__", ".*", "site-packages", "dist-packages")

Record = tuple  # (kind: str, source: str, line: int | None, payload)
BOM = "\ufeff"  # a UTF-8 byte-order mark, as some editors write at the start of a file


class CorruptInput(ValueError):
    """An input file that cannot be read to its end (a truncated or damaged .gz)."""


@dataclass
class InputPlan:
    """The resolved input files and how each is read."""

    files: list[tuple[str, str]]  # (kind, path) with kind in {"jsonl", "text", "parquet", "csv", "arrow"}
    filtered_out: int = 0  # files in folders skipped by suffix (reported, not silent)
    total_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def _kind_of(path: str) -> str:
    low = path.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    for suffix, kind in DATASETS_SUFFIXES.items():
        if low.endswith(suffix):
            return kind
    return "text"


def resolve_inputs(
    inputs: list[str], text_suffixes: tuple[str, ...] | None = DEFAULT_TEXT_SUFFIXES, excludes=DEFAULT_EXCLUDES
) -> InputPlan:
    """Expand files, folders (recursively, sorted) and glob patterns into an ordered file list.

    Files named explicitly are always taken (``.json`` read as Megatron's loose jsonl). Inside
    folders, text files are filtered by suffix (``text_suffixes`` None takes every file),
    ``.jsonl``/``.ndjson``/parquet/csv/arrow files are taken and ``.json`` files are skipped.
    """
    plan = InputPlan(files=[])
    for item in inputs:
        if os.path.isdir(item):
            for root, dirs, names in os.walk(item):
                dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, pat) for pat in excludes))
                for name in sorted(names):
                    path = os.path.join(root, name)
                    kind = _kind_of(path)
                    # ".json" is jsonl only when named explicitly; in a folder it is usually data, not corpus.
                    ambiguous = name.lower().endswith((".json", ".json.gz"))
                    wanted_text = text_suffixes is None or name.lower().endswith(tuple(text_suffixes))
                    if (kind == "text" and not wanted_text) or ambiguous:
                        plan.filtered_out += 1
                        continue
                    plan.files.append((kind, path))
        elif os.path.isfile(item):
            plan.files.append((_kind_of(item), item))
        else:
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{item}: no such file, folder or glob match; check --input")
            plan.files.extend((_kind_of(m), m) for m in matches if os.path.isfile(m))
    plan.total_bytes = sum(os.path.getsize(p) for _, p in plan.files)
    return plan


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def iter_records(files: list[tuple[str, str]], json_keys: list[str]) -> Iterator[tuple[Record, int]]:
    """Yield ``(record, bytes_on_disk_consumed)`` in input order."""
    for kind, path in files:
        if kind == "text":
            yield ("file", path, None, path), os.path.getsize(path)
        elif kind == "jsonl":
            yield from _iter_jsonl(path)
        else:
            yield from _iter_datasets_rows(kind, path, json_keys)


def _iter_jsonl(path: str) -> Iterator[tuple[Record, int]]:
    compressed, lineno = path.lower().endswith(".gz"), 0
    try:
        with _open_binary(path) as f:
            last = 0
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue  # blank lines are layout, not documents
                if compressed:  # progress in compressed bytes, so the total stays the file size
                    pos = f.fileobj.tell()
                    done, last = pos - last, pos
                else:
                    done = len(raw)
                yield ("json", path, lineno, raw), done
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise CorruptInput(f"{path}: truncated or corrupt compressed data after line {lineno} ({e})") from None


def _iter_datasets_rows(kind: str, path: str, json_keys: list[str]) -> Iterator[tuple[Record, int]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach for the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import load_dataset

    ds = load_dataset(kind, data_files=path, split="train", streaming=True)
    columns = set(ds.column_names or [])
    missing = [k for k in json_keys if columns and k not in columns]
    if missing:
        raise KeyError(f"{path}: no column(s) {missing} (has {sorted(columns)}); set --json-keys")
    size = os.path.getsize(path)
    rows = 0
    for rows, row in enumerate(ds, start=1):
        yield ("row", path, rows, {k: row.get(k) for k in json_keys}), 0
    if rows == 0:
        logger.warning("%s: no rows", path)
    yield ("none", path, None, None), size  # credit the file's bytes to the progress bar at its end


def parse_record(record: Record, json_keys: list[str]) -> tuple[dict[str, str] | None, int, str | None]:
    """(texts by key, utf-8 bytes, error) for one record; error is a short reason when malformed."""
    kind, source, line, payload = record
    if kind == "none":
        return None, 0, None
    if kind == "file":
        with open(payload, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8").removeprefix(BOM)
        except UnicodeDecodeError as e:
            bad_line = raw[: e.start].count(b"\n") + 1
            return None, 0, f"not UTF-8 (byte {e.start}, line {bad_line})"
        return {k: text for k in json_keys}, len(raw), None
    if kind == "json":
        try:
            text_line = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, 0, f"not UTF-8 (byte {e.start} of the line)"
        if line == 1:  # a byte-order mark opens the file, not the first record
            text_line = text_line.removeprefix(BOM)
        try:
            obj = json.loads(text_line)
        except json.JSONDecodeError as e:
            return None, 0, f"invalid JSON ({e.msg} at column {e.colno})"
        if not isinstance(obj, dict):
            return None, 0, f"JSON {type(obj).__name__}, expected an object"
        nbytes = len(payload)
    else:
        obj, nbytes = payload, 0
    out = {}
    for key in json_keys:
        if key not in obj or obj[key] is None:
            return None, 0, f"missing key {key!r}"
        if not isinstance(obj[key], str):
            return None, 0, f"key {key!r} is {type(obj[key]).__name__}, expected a string"
        out[key] = obj[key]
        if kind == "row" or (kind == "json" and b"\\u" in payload):  # escapes may be surrogates
            try:
                encoded = len(obj[key].encode("utf-8"))
            except UnicodeEncodeError as e:
                return None, 0, (f"key {key!r} holds a lone surrogate {obj[key][e.start]!r} at "
                                 f"character {e.start} (not valid Unicode)")
            nbytes += encoded if kind == "row" else 0
    return out, nbytes, None
