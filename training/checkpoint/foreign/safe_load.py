"""Unpickling other frameworks' `.pt` files without running their code.

Megatron-LM and DeepSpeed save pickles. They are read with `torch.load(weights_only=True)`, whose
unpickler builds tensors, containers and numbers only, plus an explicit allowlist:
`argparse.Namespace` (Megatron's `args`), numpy's array reconstruction (the saved NumPy RNG
state), and stand-ins for the few enums and plain classes those frameworks put in their files
(`ModelType`, `AttnBackend`, DeepSpeed's `ZeroStageEnum`, loss scalers, fragment addresses). A
stand-in keeps the value or attributes it was saved with and runs nothing. Any other class is
refused in one line naming it.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import re

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata


class ForeignValue:
    """A stand-in for an enum member or a plain object of another framework: `value` holds an
    enum's value, attributes hold a plain object's state. `type_name` names the original class."""

    type_name = "?"

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, value=None, *args, **kwargs):
        self.value = value

    @property
    def name(self) -> str:
        return str(self._shown())

    def _shown(self):
        """An enum's value, or a plain object's attributes (set by unpickling, no `value`)."""
        return vars(self).get("value", vars(self))

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self):
        return hash((self.type_name, repr(self._shown())))

    def __repr__(self):
        return f"<{self.type_name} {self._shown()!r}>"


# The classes other frameworks' checkpoints hold that are data, not code (qualified names as
# pickled). Megatron-LM's `args` holds enums; DeepSpeed's optimizer files its ZeRO stage enum,
# loss scaler objects and the fragment addresses of its universal-checkpoint mapping.
STAND_INS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    # Megatron-LM's save_checkpoint stores the rerun state machine's state in every file
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.model.enums.ModelType",
    "megatron.model.enums.AttnMaskType",
    "megatron.legacy.model.enums.AttnMaskType",
    "megatron.enums.PositionEmbeddingType",
    # Megatron-LM's args since core_v0.14: `exit_signal` (--exit-signal, default SIGTERM)
    "signal.Signals",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.constants.PIPE_REPLICATED",
)


class UnsafeCheckpointError(ValueError):
    """A pickle holding a class outside the allowlist; the message names the file and class."""


def _stand_in(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[1], (ForeignValue,), {"type_name": qualname})


def _allowlist() -> list:
    numpy_core = "numpy.core" if np.__version__.startswith("1.") else "numpy._core"
    reconstruct = getattr(getattr(np, numpy_core.split(".")[1]).multiarray, "_reconstruct")
    allowed = [argparse.Namespace, np.ndarray, np.dtype,
               (reconstruct, "numpy.core.multiarray._reconstruct"),
               (reconstruct, "numpy._core.multiarray._reconstruct")]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.uint8)]
    allowed += [(_stand_in(q), q) for q in STAND_INS]
    return allowed


_UNSUPPORTED = re.compile(r"(?:GLOBAL|global) ([\w.]+)")


def load(path: str, data: bytes | None = None):
    """A framework's `.pt` file as plain data; refuses anything that would run code. With
    `data`, those bytes (a pickle stored inside another file, which `path` then names)."""
    try:
        with torch.serialization.safe_globals(_allowlist()):
            return torch.load(path if data is None else io.BytesIO(data), map_location="cpu",
                              weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        found = _UNSUPPORTED.search(text)
        what = found[1] if found else text.splitlines()[0][:200]
        raise UnsafeCheckpointError(
            f"{path}: holds {what}, a type outside the allowlist of "
            f"training/checkpoint/foreign/safe_load.py; refused (loading it would run its code)"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise UnsafeCheckpointError(f"{path}: unreadable ({str(e).splitlines()[0][:200]}); "
                                    f"the file is damaged or not a torch checkpoint") from None



# What torch.distributed.checkpoint pickles into a `.metadata` file besides its own metadata
# classes (module torch.distributed.checkpoint.metadata): the filesystem's storage records, the
# folder's path, torch sizes, dtypes and layouts, and the save plans Megatron-core's torch_dist
# strategy keeps in the metadata (planner records: plain dataclasses and an enum).
_DCP_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("torch.distributed.checkpoint.planner", "SavePlan"),
                ("torch.distributed.checkpoint.planner", "WriteItem"),
                ("torch.distributed.checkpoint.planner", "WriteItemType"),
                ("torch.distributed.checkpoint.planner", "TensorWriteData"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                ("torch", "Size"), ("torch.serialization", "_get_layout")}


# DCP's own metadata classes (named one by one: the module also holds `os` and `torch`, which a
# dotted name such as "os.system" would otherwise reach)
_DCP_METADATA = {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class _DCPUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name and (
                module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA
                or (module, name) in _DCP_GLOBALS
                or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name}")


def dcp_metadata(folder: str):
    """A torch.distributed.checkpoint folder's `.metadata`, unpickled with an allowlist (DCP's
    own reader unpickles it with no restriction)."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _DCPUnpickler(f).load()
    except pickle.UnpicklingError as e:
        found = _UNSUPPORTED.search(str(e))
        if not found:  # a truncated or garbled pickle, not a foreign class
            raise UnsafeCheckpointError(f"{path}: unreadable ({str(e)[:200]}); the file is "
                                        f"damaged") from None
        raise UnsafeCheckpointError(f"{path}: holds {found[1]}, outside DCP's metadata "
                                    f"classes; refused (loading it would run its code)") from None
    except (OSError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError) as e:
        raise UnsafeCheckpointError(f"{path}: unreadable ({str(e)[:200]}); not a DCP "
                                    f"checkpoint folder, or a damaged one") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's "
                                    f"Metadata; not a DCP checkpoint folder")
    return metadata


class SafeDCPReader(FileSystemReader):
    """DCP's reader, its `.metadata` unpickled through safe_load's allowlist."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self._metadata = dcp_metadata(folder)

    def read_metadata(self, *args, **kwargs):
        if getattr(self._metadata, "storage_meta", None) is not None:
            self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata


class SafeBytesPlanner(DefaultLoadPlanner):
    """Non-tensor entries unpickled with weights_only=True (plain numbers and containers)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
