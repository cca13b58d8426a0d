"""tests/deepspeed_engine.py launched under torchrun by the tests (not a test module).

`start` returns once DeepSpeed's training runs are written (OUT/trained); `finish` tells a
waiting session what to do and waits for it, `end` waits for a `train` launch's exit. A SIGABRT
(DeepSpeed on CPU, now and then) before the records are written is retried, one after them is
not the runs' failure; any other failure fails the test with the output's tail.
"""
import os
import subprocess
import sys
import time

import pytest

from tests.distributed import free_port

_ABORT_TRIES = 3


def start(out: str, mode: str, world: int) -> subprocess.Popen:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(world), "--master_port", str(free_port()),
           "-m", "tests.deepspeed_engine", mode, out]
    done = os.path.join(out, "trained")
    for attempt in range(_ABORT_TRIES):
        log = open(os.path.join(out, f"launch{attempt}.log"), "w+")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while proc.poll() is None and not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        if os.path.exists(done):
            proc.log = log
            return proc
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        if not aborted(text):
            break
    pytest.fail(f"DeepSpeed's training runs failed (exit {proc.returncode}):\n{text[-4000:]}")


def finish(out: str, name: str, proc: subprocess.Popen, timeout: float) -> None:
    """Tell the waiting session what to do (the file OUT/<name>) and wait for it to end."""
    open(os.path.join(out, name), "w").close()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def aborted(text: str) -> bool:
    return "SIGABRT" in text or "Signal 6" in text


def end(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait for a launch whose records are written to exit: 0, or DeepSpeed's abort on the way
    out."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc.log.seek(0)
    text = proc.log.read()
    proc.log.close()
    if proc.returncode != 0 and not aborted(text):
        pytest.fail(f"DeepSpeed's launch failed on exit ({proc.returncode}):\n{text[-4000:]}")
