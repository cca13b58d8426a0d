"""tests/deepspeed_engine.py launched under torchrun by the tests (not a test module).

`start` returns once DeepSpeed's training runs are written (OUT/trained for the `session` mode,
the launch's end for `train`); `finish` tells a waiting session what to do and waits for it. A
start-up SIGABRT (DeepSpeed on CPU, now and then) is retried; any other failure fails the test
with the output's tail.
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
        if os.path.exists(done) or (mode == "train" and proc.returncode == 0):
            proc.log = log
            return proc
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        if "SIGABRT" not in text and "Signal 6" not in text:
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
