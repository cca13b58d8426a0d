"""The tools/ scripts run in the test process, and the files the data tools read and write
(not a test module)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures import GPT2

ROOT = Path(__file__).resolve().parents[1]  # the repository
REPO = str(ROOT)


def tool_module(name):
    """A tools/ script as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, f"tools/{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_output(name, *argv) -> tuple[int, str, str]:
    """tools/<name>.py's main in this process, `sys.argv` set as its command line would set it:
    (exit status, stdout, stderr). An interpreter start and an import of the training stack less
    than running the script (one test per tool still runs the script itself)."""
    out, err, argv_before = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [os.path.join(REPO, "tools", f"{name}.py"), *map(str, argv)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = tool_module(name).main()
    finally:
        sys.argv = argv_before
    return rc, out.getvalue(), err.getvalue()


def convert_hf_tool(*argv):
    return tool_module("convert_hf").main(list(argv))


def generate_tool(argv):
    """tools/generate.py's main in this (spawned) process; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tool_module("generate").main(argv) == 0
    return out.getvalue().strip()


def load_tool(name):
    """Import tools/<name>.py (not a package); registered so dataclasses and pickling (fork) work."""
    if f"tool_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"tool_{name}"]


def preprocess(*args, ok=True, subprocess_run=False):
    """Run the tool in this process (fast: no interpreter start), or as the real script."""
    argv = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(GPT2 / "vocab.json"),
            "--merge-file", str(GPT2 / "merges.txt"), "--no-progress", *map(str, args)]
    if subprocess_run:
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *argv],
                              capture_output=True, text=True, timeout=120)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = load_tool("preprocess_data").main(argv)
        out = buf.getvalue()
    assert (rc == 0) == ok, out
    return out


def read_docs(prefix):
    from megazoo.data.indexed import IndexedDataset
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))], ds


def write_jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
