"""examples/slurm/train_gpt.sbatch: its training flags are the README's one-node command; under
Slurm it runs srun -> torchrun with c10d rendezvous on the job's first node; without Slurm the
same command trains on this node (a tiny model: 2 processes, 2 iterations, checkpoint written)."""
import os
import shlex
import subprocess
import sys

from tests.distributed import free_port
from tests.fixtures import GPT2
from tests.tool_runs import REPO, preprocess, write_jsonl

SCRIPT = os.path.join(REPO, "examples", "slurm", "train_gpt.sbatch")


def _readme_command() -> list[str]:
    """The README's one-node torchrun command, as tokens."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index("torchrun --nproc_per_node 8 train_gpt.py")
    return shlex.split(text[start:text.index("```", start)].replace("\\\n", " "))


def _dry(base: dict, **env) -> list[str]:
    done = subprocess.run(["bash", SCRIPT], env=dict(base, DRY="1", **env), cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def test_the_script_runs_the_readme_command_under_slurm_and_on_one_node(tmp_path):
    readme = _readme_command()
    assert readme[:3] == ["torchrun", "--nproc_per_node", "8"]
    flags = readme[readme.index("train_gpt.py"):]

    local = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    one = _dry(local)
    assert one[one.index("train_gpt.py"):] == flags  # the same training command
    assert one[:one.index("train_gpt.py")][:9] == [
        "torchrun", "--nnodes", "1", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "localhost:29500"]

    bin_dir = tmp_path / "bin"  # Slurm's scontrol, as the job's nodes see it (a line at a time:
    bin_dir.mkdir()               # a reader that stops after the first must not fail the script)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a17\\n'\nsleep 0.2\n"
                                      "printf 'gpu-a18\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    slurm = _dry(local, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                 SLURM_JOB_NODELIST="gpu-a[17-18]", PATH=f"{bin_dir}:{os.environ['PATH']}")
    launch = slurm[:slurm.index("train_gpt.py")]
    assert launch[0] == "srun" and launch[launch.index("torchrun"):] == [
        "torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "gpu-a17:29500", "--rdzv_id", "4242"]
    assert "--ntasks-per-node=1" in launch and slurm[slurm.index("train_gpt.py"):] == flags

    # Without Slurm, for real: the site's lines set to this machine; a tiny shape appended.
    docs = tmp_path / "docs.jsonl"
    write_jsonl(docs, ["The quick brown fox jumps over the lazy dog. " * 8] * 24)
    preprocess("--input", docs, "--output-prefix", tmp_path / "corpus", "--append-eod")
    ckpt = tmp_path / "ckpt"
    env = dict(local, GPUS_PER_NODE="2", PORT=str(free_port()), OMP_NUM_THREADS="1",
               TORCHRUN=f"{sys.executable} -m torch.distributed.run", DATA=str(tmp_path / "corpus_text_document"),
               VOCAB=str(GPT2 / "vocab.json"), MERGES=str(GPT2 / "merges.txt"), CKPT=str(ckpt),
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    tiny = ["--pipeline-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr-warmup-iters", "1", "--save-interval", "2"]
    done = subprocess.run(["bash", SCRIPT, *tiny], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip().endswith("iter_0000002"), done.stderr[-2000:]
    assert "run finished: iteration 2 of 2" in done.stderr + done.stdout
