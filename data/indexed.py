"""Megatron's MMIDIDX indexed dataset: a raw token ``.bin`` plus an ``.idx`` describing it.

``.idx`` layout (all little-endian), reproduced byte for byte:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (see DTYPE_CODES)
    u64       sequence count S
    u64       document count D (= documents + 1: a leading 0 then one end per document)
    i32 * S   sequence lengths (tokens)
    i64 * S   sequence pointers (byte offsets into .bin)
    i64 * D   document indices (sequence index where each document ends; starts at 0)

The ``.bin`` is nothing but the tokens of every sequence, back to back.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
from array import array
from typing import Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes before the arrays

# Megatron's dtype codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A malformed or inconsistent .bin/.idx pair; the message names the file and the fix."""


def optimal_dtype(vocab_size: int | None) -> type:
    """uint16 halves the .bin when every id fits (Megatron's 65,500 cut-off), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 4096  # at most 256 KiB read per file


def file_fingerprint(path: str) -> str:
    """Size plus a hash of 64 evenly spaced 4 KiB blocks (the whole file when smaller): cheap
    at any size, and a re-tokenization of the same byte size still changes it."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=8)
    with open(path, "rb") as f:
        if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
            h.update(f.read())
        else:
            stride = (size - FINGERPRINT_BLOCK) // (FINGERPRINT_BLOCKS - 1)
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(i * stride)
                h.update(f.read(FINGERPRINT_BLOCK))
    return f"{size}:{h.hexdigest()}"


def dataset_fingerprint(prefix: str) -> str:
    """The identity of a dataset's contents: its .bin's and .idx's fingerprints."""
    return f"bin {file_fingerprint(bin_path(prefix))} idx {file_fingerprint(idx_path(prefix))}"


def write_index(path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write an .idx for the given lengths (int32) and document boundaries (int64)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    # Pointers are exclusive cumulative byte offsets: where each sequence starts in .bin.
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams token sequences into ``<prefix>.bin`` and writes ``<prefix>.idx`` on finalize.

    Only the per-sequence lengths stay in memory (4 bytes each, in a compact array), so
    memory is bounded by the number of documents, never by the number of tokens.
    """

    def __init__(self, bin_file: str, dtype=np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise IndexedDatasetError(f"{bin_file}: dtype {self.dtype} has no MMIDIDX code; use uint16 or int32")
        self.bin_file = bin_file
        self._out = open(bin_file, "wb")
        self._lengths = array("i")
        self._doc_ends = array("q", [0])
        self.min_id: int | None = None
        self.max_id: int | None = None
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._lo, self._hi = (info.min, info.max) if info else (None, None)

    def add_item(self, tokens) -> None:
        """Append one sequence; ids outside the dtype's range are an error, never a wraparound."""
        arr = np.asarray(tokens)
        if arr.size and self._hi is not None and arr.dtype != self.dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._lo or hi > self._hi:
                raise IndexedDatasetError(
                    f"{self.bin_file}: token id {hi if hi > self._hi else lo} does not fit {self.dtype}; "
                    f"build with dtype=int32 (or pass the real vocab size to optimal_dtype)"
                )
        self._out.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self._track(arr)

    def add_items(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Append many sequences at once from one flat array (the fast path for workers)."""
        arr = np.asarray(tokens)
        if arr.size and self._hi is not None and arr.dtype != self.dtype:
            if int(arr.min()) < self._lo or int(arr.max()) > self._hi:
                raise IndexedDatasetError(
                    f"{self.bin_file}: token ids out of range for {self.dtype}; build with dtype=int32"
                )
        if int(np.sum(lengths)) != arr.size:
            raise IndexedDatasetError(f"{self.bin_file}: lengths sum to {int(np.sum(lengths))}, tokens are {arr.size}")
        self._out.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.extend(int(n) for n in lengths)
        self._track(arr)

    def _track(self, arr: np.ndarray) -> None:
        """Keep the smallest and largest id written (for the `.stats.json` sidecar)."""
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            self.min_id = lo if self.min_id is None else min(self.min_id, lo)
            self.max_id = hi if self.max_id is None else max(self.max_id, hi)

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Append many one-sequence documents from one flat array."""
        self.add_items(tokens, lengths)
        end = len(self._lengths)
        self._doc_ends.extend(range(end - len(lengths) + 1, end + 1))

    def end_document(self) -> None:
        self._doc_ends.append(len(self._lengths))

    def add_document(self, tokens, lengths: Sequence[int] | None = None) -> None:
        """Append one document made of one sequence (``lengths`` None) or several."""
        if lengths is None:
            self.add_item(tokens)
        else:
            self.add_items(np.asarray(tokens), lengths)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (merging): copy its .bin, shift its indices."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{idx_path(prefix)}: dtype {other.dtype} differs from the merge target's {self.dtype}; "
                "merge only datasets tokenized with the same vocabulary size"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_ends.extend((other.document_indices[1:] + offset).tolist())
        self._out.flush()
        with open(bin_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._out, length=16 << 20)
        other.close()

    @property
    def num_documents(self) -> int:
        return len(self._doc_ends) - 1

    @property
    def num_tokens(self) -> int:
        return int(np.frombuffer(self._lengths, dtype=np.int32).sum(dtype=np.int64)) if self._lengths else 0

    def finalize(self, idx_file: str) -> None:
        self._out.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        docs = np.frombuffer(self._doc_ends, dtype=np.int64)
        write_index(idx_file, self.dtype, lengths, docs)
        logger.info("wrote %s: %d documents, %d sequences", idx_file, len(docs) - 1, len(lengths))

    def abort(self) -> None:
        """Close and delete the partial .bin (used when preprocessing fails)."""
        self._out.close()
        if os.path.exists(self.bin_file):
            os.remove(self.bin_file)


class IndexedDataset:
    """Memory-mapped reader; validates the header and both file sizes before anything is read."""

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._idx_file, self._bin_file = idx_path(path_prefix), bin_path(path_prefix)
        for p in (self._idx_file, self._bin_file):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: not found; run tools/preprocess_data.py to create {path_prefix}.{{bin,idx}}")
        self._read_index()
        self._bin = np.memmap(self._bin_file, dtype=self.dtype, mode="r") if self._bin_bytes else np.zeros(0, self.dtype)

    def _fail(self, path: str, what: str) -> None:
        raise IndexedDatasetError(f"{path}: {what}; re-run tools/preprocess_data.py to rebuild {self.path_prefix}")

    def _read_index(self) -> None:
        p = self._idx_file
        size = os.path.getsize(p)
        if size < HEADER_SIZE:
            self._fail(p, f"only {size} bytes, shorter than the {HEADER_SIZE}-byte MMIDIDX header")
        with open(p, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            self._fail(p, f"bad magic {header[:9]!r} (expected {MAGIC!r}); not a Megatron MMIDIDX index")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            self._fail(p, f"unsupported version {version} (expected {VERSION})")
        code = header[17]
        if code not in DTYPE_CODES:
            self._fail(p, f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        seq_count, doc_count = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + seq_count * (4 + 8) + doc_count * 8
        if size != expected:
            self._fail(p, f"size {size} bytes but the header ({seq_count} sequences, {doc_count} document entries) implies {expected}")
        if seq_count:
            mm = np.memmap(p, dtype=np.uint8, mode="r")
            self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=seq_count, offset=HEADER_SIZE)
            self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=seq_count, offset=HEADER_SIZE + 4 * seq_count)
            self.document_indices = np.frombuffer(mm, dtype="<i8", count=doc_count, offset=HEADER_SIZE + 12 * seq_count)
        else:
            self.sequence_lengths = np.zeros(0, np.int32)
            self.sequence_pointers = np.zeros(0, np.int64)
            with open(p, "rb") as f:
                f.seek(HEADER_SIZE)
                self.document_indices = np.frombuffer(f.read(8 * doc_count), dtype="<i8")
        docs = self.document_indices
        if doc_count < 1 or docs[0] != 0 or docs[-1] != seq_count or (doc_count > 1 and np.any(np.diff(docs) < 0)):
            self._fail(p, "document indices must start at 0, never decrease and end at the sequence count")
        if seq_count and np.any(self.sequence_lengths < 0):
            self._fail(p, "negative sequence length")
        item = self.dtype.itemsize
        self._check_pointers(p, item)
        want = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item if seq_count else 0
        self._bin_bytes = os.path.getsize(self._bin_file)
        if self._bin_bytes != want:
            kind = "truncated" if self._bin_bytes < want else "longer than its index"
            raise IndexedDatasetError(
                f"{self._bin_file}: {kind} ({self._bin_bytes} bytes, the .idx expects {want}); "
                f"the .bin and .idx do not belong together or a write was cut short: re-run tools/preprocess_data.py"
            )

    def _check_pointers(self, path: str, item: int, chunk: int = 1 << 22) -> None:
        """Pointers must be the running byte offsets of the lengths (chunked: bounded memory)."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        start = 0
        for lo in range(0, len(lengths), chunk):
            hi = min(lo + chunk, len(lengths))
            expect = start + np.concatenate(([0], np.cumsum(lengths[lo : hi - 1], dtype=np.int64) * item))
            if not np.array_equal(pointers[lo:hi], expect):
                bad = lo + int(np.argmax(pointers[lo:hi] != expect))
                self._fail(path, f"sequence pointer {bad} is {int(pointers[bad])}, lengths imply {int(expect[bad - lo])}")
            start = int(expect[-1]) + int(lengths[hi - 1]) * item

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def sequence_count(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx``, a view into the mmap."""
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self._bin[start : start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def all_tokens(self) -> np.ndarray:
        """The whole .bin as one memory-mapped array (every sequence, back to back)."""
        return self._bin

    def __iter__(self) -> Iterable[np.ndarray]:
        for i in range(len(self)):
            yield self.get(i)

    def close(self) -> None:
        # Drop the mmaps so the files can be replaced (matters on Windows, harmless elsewhere).
        self._bin = None
        self.sequence_lengths = self.sequence_pointers = self.document_indices = None


def merge_datasets(prefixes: Sequence[str], output_prefix: str, progress=iter) -> IndexedDataset:
    """Concatenate several datasets (same dtype) into ``output_prefix``, documents in order.

    ``progress`` wraps the prefix list (tools pass tqdm); the result is re-opened, so validated.
    """
    if not prefixes:
        raise IndexedDatasetError(f"{output_prefix}: nothing to merge; pass at least one input prefix")
    if os.path.abspath(output_prefix) in map(os.path.abspath, prefixes):
        raise IndexedDatasetError(f"{output_prefix}: output is also an input; choose another output prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(bin_path(output_prefix), dtype=dtype)
    try:
        for prefix in progress(prefixes):
            builder.add_index(prefix)
    except BaseException:
        builder.abort()
        raise
    builder.finalize(idx_path(output_prefix))
    return IndexedDataset(output_prefix)
