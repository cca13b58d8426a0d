"""How a training process ends: Ctrl-C / SIGTERM save and exit 130 / 143, a flag typo or a bad
configuration is one line from rank 0 with exit 2, success exits 0 (bench/exit_soak.py repeats that).

The module's launches are independent processes that mostly wait on their own start-up: they all
start at once (the `launches` fixture), and each test checks its own."""
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.distributed import free_port
from tests.helpers import TINY
from tests.tool_runs import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))


def _torchrun(nproc, argv):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), os.path.join(REPO, "train_gpt.py"), *argv]


def _interrupt_after(cmd, line_marker, sig, whole_group):
    """Start cmd, send `sig` once `line_marker` appears in its output; return (rc, output)."""
    p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            if line_marker in line and not any("sent" == x for x in out):
                out.append("sent")
                os.killpg(p.pid, sig) if whole_group else p.send_signal(sig)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, "".join(out)


def _signal_run(folder, sig):
    argv = TINY + ["--train-iters", "1000", "--log-interval", "1", "--save", str(folder)]
    return _interrupt_after([sys.executable, os.path.join(REPO, "train_gpt.py"), *argv], "train iter 2/",
                            sig, whole_group=False)


def _ctrl_c_run(folder):
    argv = TINY + ["--train-iters", "1000", "--log-interval", "1", "--save", str(folder),
                   "--tensor-model-parallel-size", "2"]
    return _interrupt_after(_torchrun(2, argv), "train iter 2/", signal.SIGINT, whole_group=True)


def _run(cmd):
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """name -> (its folder, the Future of its result), every launch started at once."""
    root = tmp_path_factory.mktemp("shutdown")
    jobs = {"SIGINT": (_signal_run, signal.SIGINT), "SIGTERM": (_signal_run, signal.SIGTERM),
            "ctrl-c": (_ctrl_c_run,),
            "typo": (_run, None, _torchrun(2, TINY + ["--train-iters", "1", "--seq-len", "8"])),
            "bad config": (_run, None, [sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY,
                                        "--train-iters", "1", "--global-batch-size", "7"])}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {}
        for name, (fn, *args) in jobs.items():
            folder = root / name.replace(" ", "_")
            if fn is _run:
                futures[name] = (folder, pool.submit(fn, *args[1:]))
            else:
                futures[name] = (folder, pool.submit(fn, folder, *args))
        yield futures


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_and_exits_with_the_signal_code(launches, sig, code):
    folder, future = launches[sig.name]
    rc, out = future.result()
    assert rc == code, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    stopped = open(os.path.join(folder, "latest")).read().strip()
    assert f"stopping at iteration {int(stopped[5:])}, checkpoint written" in out, out


def test_ctrl_c_under_torchrun_saves_once_on_every_rank(launches):
    """Ctrl-C reaches torchrun and both workers (the terminal's process group); torchrun forwards it
    again. The workers finish the step, save together and exit 130; only torchrun's own report remains."""
    folder, future = launches["ctrl-c"]
    rc, out = future.result()
    assert rc != 0
    assert out.count("Traceback") <= 1 and "KeyboardInterrupt" not in out, out  # torchrun's, not ours
    assert "exitcode  : 130" in out or "got signal: 2" in out, out
    assert out.count("stopping at iteration") == 1, out
    assert os.path.exists(os.path.join(folder, open(os.path.join(folder, "latest")).read().strip()))


def test_flag_typo_and_bad_config_print_one_line_once(launches):
    typo = launches["typo"][1].result()
    assert typo.returncode != 0
    assert typo.stderr.count("error: unrecognized arguments: --seq-len 8") == 1, typo.stderr
    assert "usage:" not in typo.stderr
    single = launches["bad config"][1].result()
    assert single.returncode == 2 and "Traceback" not in single.stderr
    assert single.stderr.strip().splitlines() == [
        "error: --global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1"]
