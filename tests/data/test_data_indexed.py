"""MMIDIDX reader/writer: byte-exact format, round trips, merging, and every kind of bad file."""
import struct

import numpy as np
import pytest

from megazoo.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    merge_datasets,
    optimal_dtype,
)


def write(prefix, docs, dtype):
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(d)
    b.finalize(str(prefix) + ".idx")
    return IndexedDataset(str(prefix))


def test_hand_computed_two_documents_byte_exact(tmp_path):
    # Two documents of 3 and 5 tokens, uint16. Expected bytes written out by hand from the spec.
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + (1).to_bytes(8, "little")  # version
        + bytes([8])  # dtype code: uint16
        + (2).to_bytes(8, "little")  # sequences
        + (3).to_bytes(8, "little")  # document entries: documents + 1
        + (3).to_bytes(4, "little") + (5).to_bytes(4, "little")  # lengths, int32
        + (0).to_bytes(8, "little") + (6).to_bytes(8, "little")  # byte pointers: 3 tokens * 2 bytes
        + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    )
    tokens = [[1, 2, 3], [4, 5, 6, 7, 50256]]
    expected_bin = b"".join(t.to_bytes(2, "little") for d in tokens for t in d)
    assert len(expected_idx) == 82 and len(expected_bin) == 16
    ds = write(tmp_path / "hand", tokens, np.uint16)
    assert (tmp_path / "hand.idx").read_bytes() == expected_idx
    assert (tmp_path / "hand.bin").read_bytes() == expected_bin
    assert ds.dtype == np.uint16 and len(ds) == 2 and ds.num_documents == 2
    assert ds[1].tolist() == tokens[1]
    assert ds.get(1, offset=2, length=2).tolist() == [6, 7]


@pytest.mark.parametrize("vocab,dtype", [(50257, np.uint16), (65500, np.int32), (250880, np.int32)])
def test_round_trip_and_dtype_choice(tmp_path, vocab, dtype):
    assert optimal_dtype(vocab) is dtype
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n) for n in (0, 1, 7, 300, 2)]
    ds = write(tmp_path / "rt", docs, optimal_dtype(vocab))
    assert ds.dtype == dtype
    assert [d.tolist() for d in ds] == [d.tolist() for d in docs]
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    code = (tmp_path / "rt.idx").read_bytes()[17]
    assert code == (8 if dtype is np.uint16 else 4)


def test_multi_sequence_documents_and_batch_add(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    b.add_document([1, 2, 3, 4], lengths=[1, 3])  # one document of two sequences
    b.add_documents(np.array([5, 6, 7], dtype=np.int32), [2, 1])  # two one-sequence documents
    b.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert [s.tolist() for s in ds] == [[1], [2, 3, 4], [5, 6], [7]]


def test_merge(tmp_path):
    a = write(tmp_path / "a", [[1, 2], [3]], np.uint16)
    b = write(tmp_path / "b", [[4, 5, 6]], np.uint16)
    del a, b
    merged = merge_datasets([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    assert [s.tolist() for s in merged] == [[1, 2], [3], [4, 5, 6]]
    assert merged.document_indices.tolist() == [0, 1, 2, 3]
    write(tmp_path / "c", [[70000]], np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge_datasets([str(tmp_path / "a"), str(tmp_path / "c")], str(tmp_path / "ac"))


def test_token_ids_beyond_dtype_fail(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="does not fit uint16.*int32"):
        b.add_item([1, 65536])
    with pytest.raises(IndexedDatasetError, match="out of range"):
        b.add_documents(np.array([-1, 3]), [2])
    b.abort()


def test_truncated_bin(tmp_path):
    write(tmp_path / "t", [[1, 2, 3], [4, 5]], np.uint16)
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-2])
    with pytest.raises(IndexedDatasetError, match=r"t\.bin: truncated.*re-run"):
        IndexedDataset(str(tmp_path / "t"))


def test_bin_longer_than_index(tmp_path):
    write(tmp_path / "l", [[1, 2, 3]], np.uint16)
    with open(tmp_path / "l.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match="longer than its index"):
        IndexedDataset(str(tmp_path / "l"))


def test_wrong_magic(tmp_path):
    write(tmp_path / "w", [[1]], np.uint16)
    data = bytearray((tmp_path / "w.idx").read_bytes())
    data[:7] = b"NOTIDX!"
    (tmp_path / "w.idx").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match=r"w\.idx: bad magic"):
        IndexedDataset(str(tmp_path / "w"))


def test_index_size_mismatch_and_bad_header(tmp_path):
    write(tmp_path / "s", [[1, 2], [3]], np.uint16)
    data = (tmp_path / "s.idx").read_bytes()
    (tmp_path / "s.idx").write_bytes(data[:-8])  # truncated .idx
    with pytest.raises(IndexedDatasetError, match=r"s\.idx: size .* implies"):
        IndexedDataset(str(tmp_path / "s"))
    (tmp_path / "s.idx").write_bytes(data[:20])  # shorter than a header
    with pytest.raises(IndexedDatasetError, match="header"):
        IndexedDataset(str(tmp_path / "s"))
    bad_version = data[:9] + struct.pack("<Q", 2) + data[17:]
    (tmp_path / "s.idx").write_bytes(bad_version)
    with pytest.raises(IndexedDatasetError, match="version 2"):
        IndexedDataset(str(tmp_path / "s"))
    bad_code = data[:17] + bytes([9]) + data[18:]
    (tmp_path / "s.idx").write_bytes(bad_code)
    with pytest.raises(IndexedDatasetError, match="dtype code 9"):
        IndexedDataset(str(tmp_path / "s"))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocess_data"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_inconsistent_pointers(tmp_path):
    write(tmp_path / "p", [[1, 2, 3], [4, 5]], np.uint16)
    data = bytearray((tmp_path / "p.idx").read_bytes())
    data[34 + 8 + 8 : 34 + 8 + 16] = (4).to_bytes(8, "little")  # second pointer: 4 instead of 6
    (tmp_path / "p.idx").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match="sequence pointer 1 is 4, lengths imply 6"):
        IndexedDataset(str(tmp_path / "p"))
