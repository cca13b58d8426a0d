"""tools/preprocess_data.py and tools/merge_datasets.py end to end, on inputs built in tmp_path."""
import gzip
import json

import numpy as np
import pytest

from megazoo.data.indexed import IndexedDataset
from megazoo.data.text_sources import iter_records
from megazoo.data.tokenizers import build_tokenizer
from tests.fixtures import GPT2
from tests.tool_runs import load_tool, preprocess, read_docs, write_jsonl


DOCS = ["first document\n", "second one with émoji 😀", "third\n\n  spaced   out", "x" * 5000]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("GPT2BPETokenizer", str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))


def expected(tok, docs, eod=True):
    return [tok.encode(d) + ([tok.eod] if eod else []) for d in docs]


def test_jsonl_matches_direct_tokenization(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = preprocess("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "o", "--append-eod",
                     subprocess_run=True)  # once as the real command line, from the checkout
    docs, ds = read_docs(tmp_path / "o_text_document")
    assert docs == expected(tok, DOCS)
    assert ds.dtype == np.uint16
    assert "4 documents" in out
    stats = json.load(open(tmp_path / "o_text_document.stats.json"))  # for the vocabulary check
    assert stats["max_token_id"] == max(max(d) for d in docs) and stats["dtype"] == "uint16"
    assert stats["tokenizer"]["type"] == "GPT2BPETokenizer" and stats["tokenizer"]["vocab_size"] == 50257


def test_workers_partitions_gz_give_identical_files(tmp_path):
    many = [f"document number {i} " * (i % 7 + 1) for i in range(600)]
    write_jsonl(tmp_path / "a.jsonl", many[:300])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in many[300:])
    inputs = ["--input", tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", "--append-eod"]
    preprocess(*inputs, "--output-prefix", tmp_path / "w1", "--workers", "1")
    preprocess(*inputs, "--output-prefix", tmp_path / "w2", "--workers", "2", "--partitions", "2")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (tmp_path / f"w2_text_document{ext}").read_bytes()
    assert not list(tmp_path.glob("*.part*"))
    assert IndexedDataset(str(tmp_path / "w1_text_document")).num_documents == 600


def test_malformed_lines_counted_with_line_numbers(tmp_path, tok):
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"other": "missing key"}),
        json.dumps(["a", "list"]),
        "",  # blank lines are layout, not records
        json.dumps({"text": 42}),
        json.dumps({"text": "good two"}),
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff\xfe bytes"}\n' + json.dumps({"text": ""}).encode() + b"\n"
    (tmp_path / "m.jsonl").write_bytes(raw)
    out = preprocess("--input", tmp_path / "m.jsonl", "--output-prefix", tmp_path / "o", "--append-eod")
    assert "skipped 5 malformed and 1 empty" in out
    for n, reason in [(2, "invalid JSON"), (3, "missing key 'text'"), (4, "JSON list, expected an object"),
                      (6, "key 'text' is int, expected a string"), (8, "not UTF-8")]:
        assert f"m.jsonl:{n}: {reason}" in out
    skipped = (tmp_path / "o_skipped.txt").read_text()
    assert skipped.count("\n") == 6 and "m.jsonl:9\tempty document" in skipped
    docs, _ = read_docs(tmp_path / "o_text_document")
    assert docs == expected(tok, ["good one", "good two"])
    out = preprocess("--input", tmp_path / "m.jsonl", "--output-prefix", tmp_path / "s", "--strict", ok=False)
    assert "m.jsonl:2: invalid JSON" in out and "--strict" in out
    assert not (tmp_path / "s_text_document.bin").exists() and not (tmp_path / "s_text_document.idx").exists()


def test_text_folder_one_document_per_file_and_non_utf8(tmp_path, tok):
    root = tmp_path / "src"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("import os\n\nprint(os.sep)\n")
    (root / "pkg" / "b.txt").write_text("héllo\tworld\n")
    (root / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\x00\x01")
    (root / "pkg" / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    (root / "pkg" / "image.png").write_bytes(b"\x89PNG")
    out = preprocess("--input", root, "--output-prefix", tmp_path / "o", "--append-eod", "--workers", "2")
    docs, _ = read_docs(tmp_path / "o_text_document")
    assert docs == expected(tok, ["import os\n\nprint(os.sep)\n", "héllo\tworld\n"])
    assert "latin1.py: not UTF-8 (byte 5, line 1)" in out
    assert "1 files in folders skipped by suffix" in out


def test_datasets_formats(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[:2], "n": [1, 2]}), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text('text,n\n"csv, quoted",1\nplain,2\n')
    table = pa.table({"text": ["from arrow"]})
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    out = preprocess("--input", tmp_path / "d.parquet", tmp_path / "d.csv", tmp_path / "d.arrow", "--output-prefix", tmp_path / "o")
    docs, _ = read_docs(tmp_path / "o_text_document")
    assert docs == expected(tok, DOCS[:2] + ["csv, quoted", "plain", "from arrow"], eod=False)
    with pytest.raises(KeyError, match=r"d.parquet: no column\(s\) \['body'\].*--json-keys"):
        list(iter_records([("parquet", str(tmp_path / "d.parquet"))], ["body"]))


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    out = preprocess("--input", tmp_path / "empty.jsonl", "--output-prefix", tmp_path / "o", ok=False)
    assert "no documents written" in out and "--json-keys" in out
    assert not (tmp_path / "o_text_document.bin").exists()
    out = preprocess("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "o", ok=False)
    assert "nope.jsonl: no such file" in out


def test_merge_tool(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:2])
    write_jsonl(tmp_path / "b.jsonl", DOCS[2:])
    preprocess("--input", tmp_path / "a.jsonl", "--output-prefix", tmp_path / "shards" / "a", "--append-eod")
    preprocess("--input", tmp_path / "b.jsonl", "--output-prefix", tmp_path / "shards" / "b", "--append-eod")
    (tmp_path / "shards" / "a_skipped.txt").unlink(missing_ok=True)
    assert load_tool("merge_datasets").main(["--input", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "all")]) == 0
    docs, _ = read_docs(tmp_path / "all")
    assert docs == expected(tok, DOCS)


def test_end_to_end_into_a_dataloader(tmp_path, tok):
    import torch

    from megazoo.data.blended import build_train_valid_test_datasets
    from megazoo.data.samplers import PretrainingSampler

    texts = [f"Document {i}: " + "lorem ipsum dolor " * (i % 5 + 1) for i in range(40)]
    write_jsonl(tmp_path / "c.jsonl", texts)
    preprocess("--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "c", "--append-eod")
    train, valid, test = build_train_valid_test_datasets(
        [str(tmp_path / "c_text_document")], "90,10,0", seq_length=32, seed=7, num_samples=(64, 8, 0),
        cache_dir=str(tmp_path / "cache"))
    assert test is None and len(train) >= 64 and len(valid) >= 8
    sampler = PretrainingSampler(64, consumed_samples=16, micro_batch_size=4, dp_rank=1, dp_size=2)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler)
    batches = list(loader)
    assert len(batches) == 6 and batches[0]["tokens"].shape == (4, 33) and batches[0]["tokens"].dtype == torch.int64
    # Every sample decodes to pieces of the documents, cut at the eod tokens between them.
    for row in torch.cat([b["tokens"] for b in batches]):
        pieces = tok.decode(row.tolist()).split("<|endoftext|>")
        assert all(any(piece in t for t in texts) for piece in pieces), pieces
        assert all(piece in texts for piece in pieces[1:-1])  # inner pieces are whole documents
