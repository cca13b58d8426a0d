"""How a training process ends: Ctrl-C / SIGTERM save and exit 130 / 143, a flag typo or a bad
configuration is one line from rank 0 with exit 2, success exits 0 (bench/exit_soak.py repeats that)."""
import os
import signal
import subprocess
import sys

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


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_and_exits_with_the_signal_code(tmp_path, sig, code):
    argv = TINY + ["--train-iters", "1000", "--log-interval", "1", "--save", str(tmp_path)]
    rc, out = _interrupt_after([sys.executable, os.path.join(REPO, "train_gpt.py"), *argv], "train iter 2/",
                               sig, whole_group=False)
    assert rc == code, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    stopped = open(os.path.join(tmp_path, "latest")).read().strip()
    assert f"stopping at iteration {int(stopped[5:])}, checkpoint written" in out, out


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
    typo = subprocess.run(_torchrun(2, TINY + ["--train-iters", "1", "--seq-len", "8"]), cwd=REPO, env=ENV,
                          capture_output=True, text=True)
    assert typo.returncode != 0
    assert typo.stderr.count("error: unrecognized arguments: --seq-len 8") == 1, typo.stderr
    assert "usage:" not in typo.stderr
    single = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY, "--train-iters", "1",
                             "--global-batch-size", "7"], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert single.returncode == 2 and "Traceback" not in single.stderr
    assert single.stderr.strip().splitlines() == [
        "error: --global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1"]
