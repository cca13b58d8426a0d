"""The package is one namespace: the built wheel holds `megazoo/` (and its metadata) only, every
source folder of the package is listed in pyproject.toml, and the installed wheel trains a tiny
model from an empty directory through its console entry point."""
import os
import subprocess
import sys
import zipfile

import pytest

from tests.tool_runs import REPO

PACKAGE_ROOTS = ("models", "parallel", "data", "training", "tools")


def _pyproject_packages() -> set[str]:
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["tool"]["setuptools"]["packages"])


def test_every_source_folder_is_a_listed_package():
    """A new folder of modules (a model family, say) that pyproject.toml does not list would be
    missing from the wheel while every test in the checkout passes."""
    found = set()
    for top in PACKAGE_ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if any(f.endswith(".py") for f in filenames):
                rel = os.path.relpath(dirpath, REPO).replace(os.sep, ".")
                found.add("megazoo." + rel)
                assert "__init__.py" in filenames, f"{dirpath} has modules but no __init__.py"
    assert found == _pyproject_packages(), ("pyproject.toml [tool.setuptools] packages differ: "
                                            f"missing {sorted(found - _pyproject_packages())}, "
                                            f"extra {sorted(_pyproject_packages() - found)}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), REPO], check=True, capture_output=True, text=True)
    (path,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    return path


def test_wheel_holds_only_megazoo(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"megazoo", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "megazoo/__init__.py" not in names  # a namespace package: nothing claims megazoo itself
    for must in ("megazoo/models/registry.py", "megazoo/training/run/cli.py",
                 "megazoo/tools/preprocess_data.py", "megazoo/parallel/zero/optimizer.py"):
        assert must in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"megazoo-train-gpt = megazoo.training.run.cli:train_gpt" in entry


def test_installed_wheel_trains_from_an_empty_directory(wheel, tmp_path):
    """pip install of the wheel (into a target folder first on the path, so this checkout's
    editable install is not what runs), then its console script from an empty directory."""
    target, work = tmp_path / "site", tmp_path / "empty"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    # where the import system finds the package (the console script below imports it for real)
    where = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('megazoo.models.registry').origin)"],
                           cwd=work, env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(target)), where
    run = subprocess.run([str(target / "bin" / "megazoo-train-gpt"), "--num-layers", "2",
                          "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                          "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
                          "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
                          "--train-iters", "3", "--log-interval", "1", "--save", "ckpt"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "train iter 3/3" in run.stderr + run.stdout
    assert (work / "ckpt" / "latest").exists() or any((work / "ckpt").glob("iter_*"))
