"""Atomic, sharded checkpoints in safetensors (nothing is unpickled on load).

Layout of `--save DIR`:

    DIR/latest                      "iter_0000200" (written last, by rename)
    DIR/iter_0000200/meta.json      iteration, data position, layout, model config, file list
    DIR/iter_0000200/rank_00003.safetensors   this rank's model shards, optimizer shards, RNG

Every rank writes into `iter_N.tmp/`; once every rank has, rank 0 writes meta.json, renames the
folder to `iter_N`, then replaces `latest`. A crash at any point leaves `latest` naming a complete
checkpoint; a stale `.tmp` folder is ignored and cleared by the next save. A rank that cannot
write (no space, I/O error) stops every rank with one line; the previous checkpoint stays.

Every rank file records a crc32 per tensor in its header (`training/checkpoint/integrity.py`); every reader
here verifies what it reads, and a resume falls back to the newest checkpoint that verifies
(`candidates`). The folder names, the `latest` pointer and which folder a resume reads:
`training/checkpoint/folders.py`; the errors: `training/checkpoint/errors.py` (both re-exported
here). Disk space, retention and the folder lock: `training/checkpoint/storage.py`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import dataclasses
from dataclasses import asdict

import torch
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import save_file

from megazoo.models.config import TransformerConfig
from megazoo.parallel import collectives as C

from megazoo.training.checkpoint import integrity
from megazoo.training.checkpoint import storage
from megazoo.training.checkpoint.errors import CheckpointError, IntegrityError
from megazoo.training.checkpoint.folders import (candidates, iteration_dir,  # noqa: F401 - re-exported
                                                 latest_checkpoint, rank_file, read_pointer, resolve)

logger = logging.getLogger(__name__)


def _fsync_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, iteration: int, rank: int, world_size: int,
                    tensors: dict[str, torch.Tensor], meta: dict, device=None) -> str:
    """Collective: every rank passes its own tensors; rank 0's `meta` is recorded.

    Every phase ends with an agreement over all ranks, so a rank that cannot write (no space,
    I/O error) stops every rank with the same one-line error and `latest` keeps naming the
    previous complete checkpoint. `--async-save` runs the same phases with the write on a
    background thread between them (`training/checkpoint/async_writer.py`)."""
    tmp = begin_save(root, iteration, rank, world_size, tensors, device)
    return finish_save(root, iteration, rank, world_size, meta, device,
                       write=lambda: write_rank_file(tmp, rank, tensors))


def begin_save(root: str, iteration: int, rank: int, world_size: int,
               tensors: dict[str, torch.Tensor], device=None, then=None) -> str:
    """The first phases of a save (room for it, a fresh `.tmp` folder, then `then` if given:
    each agreed by every rank); returns that folder."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    _phase(root, iteration, device, lambda: _fail(storage.free_space_problem(
        root, sum(t.numel() * t.element_size() for t in tensors.values()), world_size,
        latest_checkpoint(root) if os.path.isdir(root) else None)))
    _phase(root, iteration, device, lambda: _prepare(root, tmp) if rank == 0 else None)
    if then is not None:
        _phase(root, iteration, device, then, cleanup=tmp)
    return tmp


def finish_save(root: str, iteration: int, rank: int, world_size: int, meta: dict, device,
                write) -> str:
    """The last phases: `write` (this rank's file, or the outcome of a background write), then,
    once every rank's file is on disk, the commit by rank 0."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    _phase(root, iteration, device, write, cleanup=tmp)
    _phase(root, iteration, device, lambda: commit(root, iteration, world_size, meta)
           if rank == 0 else None, cleanup=tmp)
    return iteration_dir(root, iteration)


def _phase(root: str, iteration: int, device, work, cleanup: str | None = None) -> None:
    """Run one save phase on this rank and agree with the others whether every rank succeeded."""
    error = None
    try:
        work()
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{root}: {_os_error(e)}"
    if all_ranks_ok(error is None, device):
        return
    if cleanup and C.group_rank(C.world()) == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    kept = read_pointer(root)
    raise CheckpointError(f"{error or 'another rank could not write its part'}; checkpoint "
                          f"{iteration} not saved, the previous one is kept "
                          f"({'latest = ' + kept if kept else 'no earlier checkpoint'})")


def _fail(problem: str | None) -> None:
    if problem:
        raise CheckpointError(problem)


def all_ranks_ok(ok: bool, device=None) -> bool:
    """Whether `ok` holds on every rank (a collective when torch.distributed is up)."""
    group = C.world()
    if C.is_single(group):
        return ok
    if device is None:  # the device this rank's collectives run on (CPU under gloo)
        device = C.collective_device(group)
    t = torch.tensor([1.0 if ok else 0.0], device=device)
    return bool(C.all_reduce(t, group, op=C.ReduceOp.MIN).item())


def _os_error(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


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
    """One rank's tensors, with their checksums in the file's header, flushed to disk."""
    path = rank_file(tmp, rank)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    try:
        save_file(cpu, path, metadata=integrity.header(cpu))
        honour_umask(path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{path}: {_os_error(e)}") from None
    except SafetensorError as e:  # the writer's I/O errors arrive as text
        full = "no space left on device" if "StorageFull" in str(e) or "No space" in str(e) \
            else str(e).splitlines()[0][:200]
        raise CheckpointError(f"{path}: {full}") from None


def commit(root: str, iteration: int, world_size: int, meta: dict) -> str:
    """Write meta.json, move the complete folder into place, then point `latest` at it.

    `latest` names a complete folder at every moment: when an iteration is saved again (after
    a rollback or resume), the old folder first gets a second name (hard links, no copy),
    `latest` moves to that name, and only then is the old folder replaced."""
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    old = final + ".old"
    meta = dict(meta, iteration=iteration, world_size=world_size,
                files=[os.path.basename(rank_file(tmp, r)) for r in range(world_size)])
    _fsync_write(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, default=_jsonable))
    if os.path.isdir(final):
        if read_pointer(root) != os.path.basename(old):
            shutil.rmtree(old, ignore_errors=True)
            _link_tree(final, old)
            _fsync_write(os.path.join(root, "latest"), os.path.basename(old))
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_write(os.path.join(root, "latest"), os.path.basename(final))
    shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    return final


def _link_tree(src: str, dst: str) -> None:
    os.makedirs(dst)
    for name in os.listdir(src):
        try:
            os.link(os.path.join(src, name), os.path.join(dst, name))
        except OSError:  # a filesystem without hard links: copy
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _jsonable(obj):
    """meta.json's encoder for the two non-JSON types a checkpoint records (configs, dtypes); any
    other value is refused, since `str()` of it would not read back as what was saved."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    raise TypeError(f"meta.json cannot record {type(obj).__name__} {obj!r}: give it as a number, "
                    f"string, list, dict, dataclass or torch.dtype")


def json_tensor(obj) -> torch.Tensor:
    """JSON as a uint8 tensor: per-file descriptions travel inside the safetensors file."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor):
    return json.loads(bytes(t.numpy().tobytes()).decode())


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{path}: unreadable checkpoint metadata ({e}); the checkpoint is "
                             f"incomplete, use an earlier one") from None


def read_resumable_meta(folder: str) -> dict:
    """meta.json with every field a resume reads (`integrity.META_FIELDS`), else IntegrityError:
    what resume and tools/inspect_checkpoint.py read, so --verify passes only what resumes."""
    meta = read_meta(folder)
    bad = integrity.meta_problem(meta)
    if bad:
        raise IntegrityError(f"{os.path.join(folder, 'meta.json')}: {bad}; the checkpoint is "
                             f"damaged, use an earlier one")
    return meta


class VerifiedReader:
    """A lazy reader of one rank file whose `get_tensor` checks each tensor's checksum."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = safe_open(path, framework="pt")
            self.table = integrity.recorded(self._f.metadata())
        except (SafetensorError, OSError, ValueError) as e:
            raise IntegrityError(f"{path}: corrupt or truncated shard ({e}); use an earlier "
                                 f"checkpoint") from None
        if self.table is None:
            logger.warning("%s records no checksums (written before megazoo did); its tensors "
                           "are not verified", path)

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            t = self._f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise IntegrityError(f"{self.path}: corrupt or truncated shard ({e}); use an earlier "
                                 f"checkpoint") from None
        bad = integrity.problem(name, t, self.table)
        if bad:
            raise IntegrityError(f"{self.path}: {bad}; use an earlier checkpoint")
        return t

    def unlisted(self) -> list[str]:
        """Checksummed tensors the file does not hold (it was cut or edited)."""
        return sorted(set(self.table or ()) - set(self.keys()))


def _existing(folder: str, rank: int) -> str:
    path = rank_file(folder, rank)
    if not os.path.exists(path):
        raise IntegrityError(f"{path} is missing: the checkpoint was written by fewer ranks or is "
                             f"incomplete")
    return path


def open_rank_file(folder: str, rank: int) -> VerifiedReader:
    """A lazy, verifying reader of one rank's file, with clear errors."""
    return VerifiedReader(_existing(folder, rank))


def load_rank_tensors(folder: str, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of one rank's file, each verified against its checksum."""
    reader = open_rank_file(folder, rank)
    return {k: reader.get_tensor(k) for k in reader.keys()}


def listed_files(folder: str, meta: dict) -> list[str]:
    """Paths of the rank files a checkpoint's meta.json lists."""
    names = meta.get("files") or [os.path.basename(rank_file(folder, r))
                                  for r in range(meta.get("world_size", 1))]
    return [os.path.join(folder, n) for n in names]


def verify_folder(folder: str) -> list[str]:
    """Problems of a checkpoint folder (one line each; empty when every tensor verifies)."""
    try:
        meta = read_meta(folder)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for path in listed_files(folder, meta):
        if not os.path.exists(path):
            problems.append(f"{path} is missing: the checkpoint is incomplete")
            continue
        try:
            reader = VerifiedReader(path)
            for k in reader.keys():
                reader.get_tensor(k)
            problems += [f"{path}: tensor {k} is missing (the file was cut or edited)"
                         for k in reader.unlisted()]
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def require_verified(folder: str) -> str:
    """`folder` when every tensor of every rank file verifies; else the first problem, raised."""
    problems = verify_folder(folder)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise IntegrityError(problems[0] + more)
    return folder


def check_compatible(meta: dict, *, model: TransformerConfig, folder: str) -> None:
    """Refuse checkpoints of another model, naming the difference (a layout may differ:
    `training/checkpoint/reshard.py` maps any layout onto any other). Every field that decides
    what the weights compute counts (`TransformerConfig.computed_fields`: all but the
    training-only ones); a field an older checkpoint lacks had its default then (it was added
    later with that value), and an older checkpoint's family is the one its fields make."""
    try:
        saved = TransformerConfig.from_saved(meta.get("model", {})).computed_fields()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}/meta.json: {e}") from None
    here = model.computed_fields()
    diffs = [k for k in dict.fromkeys([*here, *saved]) if saved.get(k) != here.get(k)]
    if diffs:
        k = diffs[0]
        raise CheckpointError(f"{folder} holds another model: {k}={saved.get(k)!r} there, "
                              f"{here.get(k)!r} here; pass matching model flags or another --load")
