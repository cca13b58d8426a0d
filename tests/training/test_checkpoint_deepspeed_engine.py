"""DeepSpeed checkpoints as DeepSpeed 0.19.8 itself writes and reads them.

One torchrun launch (tests/deepspeed_engine.py, 2 CPU ranks on gloo) runs DeepSpeed's engine on a
tiny Hugging Face Llama under ZeRO-1, 2 and 3 in fp32 and ZeRO-1 and 3 in bf16, saves each with
`engine.save_checkpoint` and records the saved model's logits and DeepSpeed's own next losses.
Checked here: every file loads through the unpickling allowlist; imported at tp=2 the logits
equal DeepSpeed's within 1e-5 and the fp32 masters equal DeepSpeed's own `zero_to_fp32` reader's
bit for bit; megazoo's resumed run (tp=2) continues with DeepSpeed's next losses; megazoo's
universal export, loaded by fresh DeepSpeed engines of the same launch (it waits for the export;
`checkpoint: {load_universal: true}`), continues with megazoo's next losses and imports back bit for bit; DeepSpeed's own
ds_to_universal.py output of the ZeRO-3 run imports with the same state.
"""
import json
import os
import subprocess
import sys
import time
import zipfile
import pickletools

import pytest
import torch

from tests.deepspeed_engine import (CASES, IDS, LR, NEXT_STEPS, TRAIN_STEPS, WORLD, batch,
                                    llama_config)
from tests.distributed import free_port, run_distributed
from tests.foreign_checkpoints import FP32, megazoo_logits

EXACT = [c for c, (_, dtype) in CASES.items() if dtype == "fp32"]
LOSS = dict(rtol=1e-4, atol=0.0)
# DeepSpeed's universal loaders: ZeRO-1 and 2 share one (DeepSpeedZeroOptimizer), ZeRO-3 has its own
RESUMED = ("zero2", "zero3")
_ABORT_TRIES = 3


def _start(out: str) -> subprocess.Popen:
    """tests/deepspeed_engine.py's session under torchrun, returned once DeepSpeed's training
    runs are written (OUT/trained); it then waits for `_resume`. A start-up SIGABRT (DeepSpeed
    on CPU, now and then) is retried, any other failure fails the test with the output's tail."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(WORLD), "--master_port", str(free_port()),
           "-m", "tests.deepspeed_engine", "session", out]
    for attempt in range(_ABORT_TRIES):
        log = open(os.path.join(out, f"launch{attempt}.log"), "w+")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while proc.poll() is None and not os.path.exists(os.path.join(out, "trained")) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if os.path.exists(os.path.join(out, "trained")):
            proc.log = log
            return proc
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        text = log.read()
        if "SIGABRT" not in text and "Signal 6" not in text:
            break
    pytest.fail(f"DeepSpeed's training runs failed (exit {proc.returncode}):\n{text[-4000:]}")


def _resume(out: str, proc: subprocess.Popen) -> None:
    """The waiting session resumes from OUT/<case>-universal (written by the test)."""
    _signal_and_wait(out, "resume.go", proc, timeout=600)
    proc.log.seek(0)
    assert proc.returncode == 0, \
        f"DeepSpeed's resume run failed (exit {proc.returncode}):\n{proc.log.read()[-4000:]}"


@pytest.fixture(scope="module")
def deepspeed_session(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("deepspeed"))
    proc = _start(out)
    yield out, proc
    if proc.poll() is None:  # the resume test did not run: the session ends without it
        _signal_and_wait(out, "resume.skip", proc, timeout=120)
    proc.log.close()


def _signal_and_wait(out: str, name: str, proc: subprocess.Popen, timeout: float) -> None:
    """Tell the waiting session what to do (the file OUT/<name>) and wait for it to end."""
    open(os.path.join(out, name), "w").close()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def deepspeed_run(deepspeed_session):
    out, _ = deepspeed_session
    llama_config().save_pretrained(os.path.join(out, "hf"))
    return out


@pytest.fixture(scope="module")
def imported(deepspeed_run, tmp_path_factory):
    """Every case imported at tp=2 (DeepSpeed ran dp=2)."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    mz = tmp_path_factory.mktemp("megazoo")
    return {case: import_checkpoint("deepspeed", os.path.join(deepspeed_run, case), str(mz / case),
                                    tp=2, hf_config=os.path.join(deepspeed_run, "hf"))
            for case in CASES}


def _record(folder, name):
    with open(os.path.join(folder, name + ".json")) as f:
        return json.load(f)


def _pickle_globals(path) -> set:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def test_deepspeed_files_load_through_the_allowlist(deepspeed_run):
    """The classes DeepSpeed's files pickle, besides torch's and containers, are exactly the
    stand-ins of safe_load.py's allowlist; every file loads with weights_only=True."""
    from megazoo.training.checkpoint.foreign import safe_load
    foreign = set()
    files = 0
    for case in CASES:
        folder = os.path.join(deepspeed_run, case, f"global_step{TRAIN_STEPS}")
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            foreign |= {g for g in _pickle_globals(path)
                        if not g.startswith(("torch.", "collections."))}
            safe_load.load(path)
            files += 1
    assert files == 3 * 3 + 2 * 4  # ZeRO-3: per-rank model states; ZeRO-1/2: one file
    assert foreign == {"deepspeed.runtime.zero.config.ZeroStageEnum",
                       "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                       "deepspeed.utils.tensor_fragment.fragment_address"}
    assert foreign <= set(safe_load.STAND_INS)


def test_deepspeed_zero_checkpoints_import_at_tp2(deepspeed_run, imported):
    """Logits (fp32 runs) within 1e-5 of DeepSpeed's engine; masters (every run, bf16 included)
    equal to DeepSpeed's own zero_to_fp32 reader's; step, iteration and samples carried over."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from megazoo.models.llama import adapter as llama
    from megazoo.training.checkpoint.reshard import read_full_state
    from tests.tool_runs import tool_module
    config = None
    for case, (stage, dtype) in CASES.items():
        record = _record(deepspeed_run, case)
        full = read_full_state(imported[case])
        if dtype == "fp32":
            torch.testing.assert_close(megazoo_logits(imported[case], IDS),
                                       torch.tensor(record["logits"]), **FP32)
        ref = get_fp32_state_dict_from_zero_checkpoint(os.path.join(deepspeed_run, case))
        config = config or llama.config_from_hf(llama_config())
        want = llama.from_hf_state_dict(ref, config)
        assert set(want) == set(full.optim["master"])
        for name, tensor in want.items():
            assert torch.equal(full.optim["master"][name], tensor.float()), (case, name)
        assert int(full.scalars["applied_steps"]) == TRAIN_STEPS, case
        assert full.meta["iteration"] == TRAIN_STEPS and full.meta["consumed_samples"] == 12
        assert float(full.optim["exp_avg_sq"]["layers.0.attention.qkv.weight"].min()) >= 0
        line = tool_module("inspect_checkpoint")._foreign(os.path.join(deepspeed_run, case))
        assert f"DeepSpeed ZeRO-{stage} checkpoint (global_step{TRAIN_STEPS}): 2 data-parallel" \
            in line, line


def _megazoo_next(rank, runs):
    """Each (imported checkpoint, fresh moments) resumed by megazoo at tp=2 on DeepSpeed's next
    global batches: the losses of NEXT_STEPS steps (fresh moments: the weights alone, Adam
    restarts)."""
    torch.set_num_threads(1)
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.checkpoint import reshard
    from megazoo.training.checkpoint.hf import checkpoint_config
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    out = []
    for folder, fresh_moments in runs:
        _, config = checkpoint_config(folder)
        model = build_model(config, topo)
        opt = build_optimizer(model, topo, OptimizerConfig(lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                                           weight_decay=0.0), torch.float32)
        reshard.load_into(reshard.read_full_state(folder), [model], opt, topo,
                          weights_only=fresh_moments, folder=folder)
        losses = []
        for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
            ids = torch.cat([batch(step, r) for r in range(WORLD)])  # DeepSpeed's global batch
            loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out


@pytest.fixture(scope="module")
def megazoo_next(imported):
    runs = [(imported[c], False) for c in EXACT] + [(imported["zero3"], True)]
    ranks = run_distributed(_megazoo_next, 2, runs)
    assert ranks[0] == ranks[1]
    return dict(zip(EXACT + ["fresh"], ranks[0]))


def test_megazoo_resumes_with_deepspeeds_next_losses(deepspeed_run, megazoo_next):
    for case in EXACT:
        want = _record(deepspeed_run, case)["next"]
        assert len(megazoo_next[case]) == len(want) == NEXT_STEPS
        torch.testing.assert_close(torch.tensor(megazoo_next[case]), torch.tensor(want), **LOSS)
    # the moments matter: restarted Adam (the weights alone) takes another second step
    fresh, kept = megazoo_next["fresh"], megazoo_next["zero3"]
    assert fresh[0] == pytest.approx(kept[0], rel=1e-6)
    assert abs(fresh[1] - kept[1]) > 10 * LOSS["rtol"] * abs(kept[1])  # measured: 30x


def test_universal_export_continues_in_deepspeed(deepspeed_session, deepspeed_run, imported,
                                                 megazoo_next):
    """megazoo's universal export (Hugging Face names) loaded by DeepSpeed's engine under ZeRO-2
    and ZeRO-3 continues with megazoo's next losses."""
    from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    from tests.tool_runs import tool_module
    export_checkpoint("deepspeed", imported["zero2"],
                      os.path.join(deepspeed_run, "zero2-universal"), universal_names="hf")
    assert tool_module("convert_checkpoint").main([  # the command line, as docs/conversion.md
        "export", "--format", "deepspeed", "--universal-names", "hf", "--load", imported["zero3"],
        "--save", os.path.join(deepspeed_run, "zero3-universal")]) == 0
    _resume(*deepspeed_session)
    for case in RESUMED:
        back = read_full_state(import_checkpoint(
            "deepspeed", os.path.join(deepspeed_run, case + "-universal"),
            os.path.join(deepspeed_run, case + "-back"),
            hf_config=os.path.join(deepspeed_run, "hf")))
        _assert_same_state(back, read_full_state(imported[case]), case)
        record = _record(deepspeed_run, case + "-universal")
        assert record["global_steps"] == TRAIN_STEPS
        assert len(record["next"]) == NEXT_STEPS
        torch.testing.assert_close(torch.tensor(record["next"]), torch.tensor(megazoo_next[case]),
                                   **LOSS)


def _assert_same_state(got, want, where):
    assert set(got.optim) == set(want.optim) == {"master", "exp_avg", "exp_avg_sq"}
    for state, tensors in want.optim.items():
        assert set(got.optim[state]) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(got.optim[state][name], tensor), (where, state, name)
    assert int(got.scalars["applied_steps"]) == int(want.scalars["applied_steps"]) == TRAIN_STEPS
    assert got.meta["iteration"] == TRAIN_STEPS and got.meta["consumed_samples"] == 12


def test_deepspeeds_own_universal_conversion_imports(deepspeed_run, imported, tmp_path,
                                                     monkeypatch):
    """DeepSpeed's ds_to_universal.py output of the ZeRO-3 run (whole states under Hugging Face
    names, saved flat) imports with the masters, moments and step of the ZeRO import."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.reshard import read_full_state
    out = tmp_path / "universal" / f"global_step{TRAIN_STEPS}"
    source = os.path.join(deepspeed_run, "zero3", f"global_step{TRAIN_STEPS}")
    from deepspeed.checkpoint import ds_to_universal  # its command line, in this process
    monkeypatch.setattr(sys, "argv", ["ds_to_universal.py", "--input_folder", source,
                                      "--output_folder", str(out), "--num_extract_workers", "1",
                                      "--num_merge_workers", "1"])
    ds_to_universal.main(ds_to_universal.parse_arguments())
    got = read_full_state(import_checkpoint("deepspeed", str(out), str(tmp_path / "mz"), dp=2,
                                            hf_config=os.path.join(deepspeed_run, "hf")))
    _assert_same_state(got, read_full_state(imported["zero3"]), "ds_to_universal")
