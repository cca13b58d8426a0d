"""How a training process ends: Ctrl-C / SIGTERM save and exit 130 / 143, a flag typo or a bad
configuration is one line from rank 0 with exit 2, success exits 0 (bench/exit_soak.py repeats that)."""
import os
import signal
import subprocess
import sys
import threading

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


def test_signal_saves_and_exits_with_the_signal_code(tmp_path):
    """SIGINT -> 130 and SIGTERM -> 143, each run in its own process, both at once (each is
    one process: the two fill the machine's cores instead of waiting for each other)."""
    cases = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}
    done = {}

    def run(name, sig):
        argv = TINY + ["--train-iters", "1000", "--log-interval", "1", "--save", str(tmp_path / name)]
        done[name] = _interrupt_after([sys.executable, os.path.join(REPO, "train_gpt.py"), *argv],
                                      "train iter 2/", sig, whole_group=False)

    threads = [threading.Thread(target=run, args=(name, sig)) for name, (sig, _) in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (sig, code) in cases.items():
        rc, out = done[name]
        assert rc == code, (name, out)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, (name, out)
        stopped = open(os.path.join(tmp_path / name, "latest")).read().strip()
        assert f"stopping at iteration {int(stopped[5:])}, checkpoint written" in out, (name, out)


def test_ctrl_c_under_torchrun_saves_once_on_every_rank(tmp_path):
    """Ctrl-C reaches torchrun and both workers (the terminal's process group); torchrun forwards it
    again. The workers finish the step, save together and exit 130; only torchrun's own report remains."""
    argv = TINY + ["--train-iters", "1000", "--log-interval", "1", "--save", str(tmp_path),
                   "--tensor-model-parallel-size", "2"]
    rc, out = _interrupt_after(_torchrun(2, argv), "train iter 2/", signal.SIGINT, whole_group=True)
    assert rc != 0
    assert out.count("Traceback") <= 1 and "KeyboardInterrupt" not in out, out  # torchrun's, not ours
    assert "exitcode  : 130" in out or "got signal: 2" in out, out
    assert out.count("stopping at iteration") == 1, out
    assert os.path.exists(os.path.join(tmp_path, open(os.path.join(tmp_path, "latest")).read().strip()))


def test_flag_typo_and_bad_config_print_one_line_once():
    # both launches at once (they are independent; each waits mostly on its own start-up)
    typo = subprocess.Popen(_torchrun(2, TINY + ["--train-iters", "1", "--seq-len", "8"]), cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    single = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY, "--train-iters", "1",
                               "--global-batch-size", "7"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    _, typo_err = typo.communicate(timeout=120)
    _, single_err = single.communicate(timeout=120)
    assert typo.returncode != 0
    assert typo_err.count("error: unrecognized arguments: --seq-len 8") == 1, typo_err
    assert "usage:" not in typo_err
    assert single.returncode == 2 and "Traceback" not in single_err
    assert single_err.strip().splitlines() == [
        "error: --global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1"]
