"""DeepSpeed checkpoints as DeepSpeed 0.19.8 itself writes and reads them.

One torchrun launch (tests/deepspeed_engine.py, 2 CPU ranks on gloo) runs DeepSpeed's engine on a
tiny Hugging Face Llama under ZeRO-1, 2 and 3 in fp32 and ZeRO-1 and 3 in bf16, saves each with
`engine.save_checkpoint` and records the saved model's logits and DeepSpeed's own next losses.
Checked here: every file loads through the unpickling allowlist; imported at tp=2 the logits
equal DeepSpeed's within 1e-5 and the fp32 masters equal DeepSpeed's own `zero_to_fp32` reader's
bit for bit; megazoo's resumed run (tp=2) continues with DeepSpeed's next losses; megazoo's
universal export, loaded by fresh DeepSpeed engines of the same launch (it waits for the export;
`checkpoint: {load_universal: true}`), continues with megazoo's next losses and imports back bit
for bit; DeepSpeed's own ds_to_universal.py output of the ZeRO-3 run imports with the same state.

The same launch, and a second one of 3 ranks, also write the matrix of checkpoints real users
have (MATRIX: the Hugging Face Trainer's two parameter groups, uneven partitions, tied
embeddings, GPT-2, Qwen2-MoE, bf16 ZeRO-2, fp16 ZeRO-1/2/3, the Trainer's checkpoint-N layout);
each imports with the masters of DeepSpeed's zero_to_fp32 reader and the masters and moments of
its engine bit for bit, and (fp32) the engine's logits. PEFT LoRA runs under ZeRO-2 and 3 (the
Trainer's adapters-only save) import as megazoo LoRA runs that continue with the engine's losses.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.deepspeed_engine import (CASES, IDS, LORA, LR, MATRIX, MICRO, NEXT_STEPS, TRAIN_STEPS,
                                    WORLD, batch, checkpoint_root, llama_config, record)
from tests.deepspeed_launch import aborted, end, finish, start
from tests.distributed import run_distributed
from tests.foreign_checkpoints import FP32, megazoo_logits, pickle_globals

EXACT = [c for c, (_, dtype) in CASES.items() if dtype == "fp32"]
LOSS = dict(rtol=1e-4, atol=0.0)
# DeepSpeed's universal loaders: ZeRO-1 and 2 share one (DeepSpeedZeroOptimizer), ZeRO-3 has its own
RESUMED = ("zero2", "zero3")


def _resume(out: str, proc: subprocess.Popen) -> None:
    """The waiting session resumes from OUT/<case>-universal (written by the test). DeepSpeed on
    CPU aborts now and then on its way out (seen: SIGABRT after every record was written); with
    every record there, that exit is not the resume's failure."""
    finish(out, "resume.go", proc, timeout=600)
    proc.log.seek(0)
    text = proc.log.read()
    done = all(os.path.isfile(os.path.join(out, c + "-universal.json")) for c in RESUMED)
    assert proc.returncode == 0 or (done and aborted(text)), \
        f"DeepSpeed's resume run failed (exit {proc.returncode}):\n{text[-4000:]}"


@pytest.fixture(scope="module")
def deepspeed_session(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("deepspeed"))
    proc = start(out, "session", WORLD)
    yield out, proc
    if proc.poll() is None:  # the resume test did not run: the session ends without it
        finish(out, "resume.skip", proc, timeout=120)
    proc.log.close()


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
            foreign |= {g for g in pickle_globals(path)
                        if not g.startswith(("torch.", "collections."))}
            safe_load.load(path)
            files += 1
    assert files == 3 * 3 + 2 * 4  # ZeRO-3: per-rank model states; ZeRO-1/2: one file
    for name in (n for n, c in MATRIX.items() if c.world == WORLD):  # the matrix's files too
        folder = os.path.join(checkpoint_root(deepspeed_run, name), f"global_step{TRAIN_STEPS}")
        for file in sorted(os.listdir(folder)):
            foreign |= {g for g in pickle_globals(os.path.join(folder, file))
                        if not g.startswith(("torch.", "collections."))}
            safe_load.load(os.path.join(folder, file))
    assert foreign == {"deepspeed.runtime.zero.config.ZeroStageEnum",
                       "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                       "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # fp16
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
        saved = record(deepspeed_run, case)
        full = read_full_state(imported[case])
        if dtype == "fp32":
            torch.testing.assert_close(megazoo_logits(imported[case], IDS),
                                       torch.tensor(saved["logits"]), **FP32)
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
    from megazoo.models.lora import apply_lora
    from megazoo.models.lora_targets import LoRASettings
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.checkpoint import reshard
    from megazoo.training.checkpoint.hf import checkpoint_config
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    out = []
    for folder, fresh_moments in runs:
        meta, config = checkpoint_config(folder)
        model = build_model(config, topo)
        if meta.get("lora"):  # an imported PEFT run: megazoo's LoRA, the base frozen
            apply_lora([model], LoRASettings.from_record(meta["lora"]), config, topo, None, 0)
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


LORA_CASES = [n for n, c in MATRIX.items() if c.lora]


@pytest.fixture(scope="module")
def lora_imported(deepspeed_run, tmp_path_factory):
    """The PEFT runs (the Trainer's checkpoint-N, adapters only) imported at tp=2."""
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    mz = tmp_path_factory.mktemp("megazoo-lora")
    return {n: import_checkpoint("deepspeed", checkpoint_root(deepspeed_run, n), str(mz / n), tp=2,
                                 hf_config=os.path.join(deepspeed_run, n + "-hf"))
            for n in LORA_CASES}


@pytest.fixture(scope="module")
def megazoo_next(imported, lora_imported):
    runs = [(imported[c], False) for c in EXACT] + [(imported["zero3"], True)] + \
        [(lora_imported[c], False) for c in LORA_CASES]
    ranks = run_distributed(_megazoo_next, 2, runs)
    assert ranks[0] == ranks[1]
    return dict(zip(EXACT + ["fresh"] + LORA_CASES, ranks[0]))


def test_megazoo_resumes_with_deepspeeds_next_losses(deepspeed_run, megazoo_next):
    for case in EXACT:
        want = record(deepspeed_run, case)["next"]
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
        resumed = record(deepspeed_run, case + "-universal")
        assert resumed["global_steps"] == TRAIN_STEPS
        assert len(resumed["next"]) == NEXT_STEPS
        torch.testing.assert_close(torch.tensor(resumed["next"]), torch.tensor(megazoo_next[case]),
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


@pytest.fixture(scope="module")
def deepspeed_world3(deepspeed_run, tmp_path_factory):
    """MATRIX's 3-rank cases: the second launch (given the first's answer of the Trainer's
    weight-decay rule)."""
    out = str(tmp_path_factory.mktemp("deepspeed3"))
    shutil.copy(os.path.join(deepspeed_run, "decay.json"), out)
    end(start(out, "train", 3))
    return out


@pytest.mark.parametrize("name", [n for n, c in MATRIX.items() if not c.frozen and not c.lora])
def test_matrix_imports_as_deepspeed_reads_it(name, request, tmp_path):
    """Masters equal to zero_to_fp32's and to the engine's own (safe_get_full_fp32_param), Adam
    moments to the engine's (safe_get_full_optimizer_state), bit for bit; fp32 logits within 1e-5
    of the engine's; step, iteration and samples carried over; fp16: DeepSpeed's dynamic loss
    scale (grown once, window 2) as megazoo's scaler state. The Trainer's layout imports
    without --hf-config (its config.json beside `latest`), from checkpoint-N or global_stepN."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.hf import read_hf_config
    from megazoo.training.checkpoint.reshard import read_full_state
    case = MATRIX[name]
    out = request.getfixturevalue("deepspeed_run" if case.world == WORLD else "deepspeed_world3")
    root, hf = checkpoint_root(out, name), os.path.join(out, name + "-hf")
    folder = import_checkpoint("deepspeed", root, str(tmp_path / "mz"), tp=2,
                               hf_config=None if case.trainer else hf)
    full = read_full_state(folder)
    _, module, hf_config = read_hf_config(hf)
    config = module.config_from_hf(hf_config)
    engine = torch.load(os.path.join(out, name + "-states.pt"), weights_only=True)
    want = {state: module.from_hf_state_dict(engine[state], config) for state in engine}
    zero_to_fp32 = module.from_hf_state_dict(get_fp32_state_dict_from_zero_checkpoint(root), config)
    assert set(zero_to_fp32) == set(full.optim["master"])
    for tensor_name, tensor in zero_to_fp32.items():
        assert torch.equal(full.optim["master"][tensor_name], tensor.float()), tensor_name
    for state, tensors in want.items():
        assert set(tensors) == set(full.optim[state])
        for tensor_name, tensor in tensors.items():
            assert torch.equal(full.optim[state][tensor_name], tensor), (state, tensor_name)
    assert int(full.scalars["applied_steps"]) == TRAIN_STEPS
    assert full.meta["iteration"] == TRAIN_STEPS
    assert full.meta["consumed_samples"] == TRAIN_STEPS * MICRO * case.world
    if case.dtype == "fp32":
        torch.testing.assert_close(megazoo_logits(folder, IDS),
                                   torch.tensor(record(out, name)["logits"]), **FP32)
    if case.dtype == "fp16":  # 3 clean steps, window 2: grown at the third (DeepSpeed's rule)
        saved = record(out, name)
        assert saved["scaler"] == dict(cur_scale=2.0 ** 17, cur_iter=3, last_overflow_iter=-1,
                                       cur_hysteresis=2) and saved["skipped"] == 0
        assert {k: float(v) for k, v in full.scalars.items() if k.startswith("scaler.")} == {
            "scaler.loss_scale": 2.0 ** 17, "scaler.growth_tracker": 0.0,
            "scaler.hysteresis_tracker": 2.0}
    if case.trainer:
        from tests.tool_runs import tool_module
        line = tool_module("inspect_checkpoint")._foreign(root)
        assert "import with --hf-config (or the Trainer's config.json beside it)" in line, line
        again = read_full_state(import_checkpoint(
            "deepspeed", os.path.join(root, f"global_step{TRAIN_STEPS}"), str(tmp_path / "mz2"),
            tp=1))
        _assert_same_state(again, full, name)


@pytest.mark.parametrize("name", [n for n, c in MATRIX.items() if c.frozen])
def test_frozen_parameters_import_as_weights_only(name, deepspeed_run, tmp_path):
    """A run whose embedding was frozen (no master nor moments for it): refused with the optimizer
    by name; with --no-optimizer the weights (the frozen one from the model-state records) equal
    zero_to_fp32's bit for bit and give the engine's logits. Saved with
    exclude_frozen_parameters=True, the missing parameter is named with that cause."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from megazoo.models.llama import adapter as llama
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.reshard import read_full_state
    root, hf = os.path.join(deepspeed_run, name), os.path.join(deepspeed_run, name + "-hf")
    with pytest.raises(CheckpointError, match=r"1 parameters were not trained \(frozen_param_"
                                              r"shapes, e\.g\. model\.embed_tokens\.weight\).*"
                                              r"--no-optimizer"):
        import_checkpoint("deepspeed", root, str(tmp_path / "refused"), hf_config=hf)
    folder = import_checkpoint("deepspeed", root, str(tmp_path / "mz"), tp=2, hf_config=hf,
                               optimizer=False)
    full = read_full_state(folder)
    want = llama.from_hf_state_dict(get_fp32_state_dict_from_zero_checkpoint(root),
                                    llama.config_from_hf(llama_config()))
    assert set(want) == set(full.weights) and not full.optim
    for tensor_name, tensor in want.items():
        assert torch.equal(full.weights[tensor_name], tensor.float()), tensor_name
    torch.testing.assert_close(megazoo_logits(folder, IDS),
                               torch.tensor(record(deepspeed_run, name)["logits"]), **FP32)
    with pytest.raises(CheckpointError, match=r"lack 'model\.embed_tokens\.weight'.*"
                                              r"exclude_frozen_parameters=True"):
        import_checkpoint("deepspeed", os.path.join(deepspeed_run, name + "-exclude-frozen"),
                          str(tmp_path / "excluded"), hf_config=hf, optimizer=False)


def test_peft_lora_runs_import_as_megazoo_lora(deepspeed_run, lora_imported, megazoo_next,
                                               tmp_path):
    """PEFT's LoRA model (every projection, r 4, alpha 8) trained by DeepSpeed's engine under
    ZeRO-2 and ZeRO-3 and saved as the Trainer saves it (exclude_frozen_parameters=True, PEFT's
    adapter_config.json in checkpoint-N): imported as a megazoo LoRA run, the adapters' masters
    equal zero_to_fp32's and the engine's, the moments the engine's, bit for bit; the base equal
    to --hf-config's safetensors; the logits the PEFT model's within 1e-5; megazoo's resumed LoRA
    steps give the engine's next losses; saved with the base (DeepSpeed's default), the same
    state with the base from its records. Without --hf-config or adapter_config.json: refused."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from megazoo.models.peft_format import from_peft_keys
    from megazoo.training.checkpoint.foreign.convert import import_checkpoint
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.hf import hf_to_full
    from megazoo.training.checkpoint.reshard import read_full_state
    for name in LORA_CASES:
        root, hf = checkpoint_root(deepspeed_run, name), os.path.join(deepspeed_run, name + "-hf")
        full = read_full_state(lora_imported[name])
        lora = full.meta["lora"]
        assert lora == dict(rank=LORA["r"], alpha=LORA["lora_alpha"], dropout=0.0, rslora=False,
                            targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"])
        _, config, base = hf_to_full(hf)
        engine = torch.load(os.path.join(deepspeed_run, name + "-states.pt"), weights_only=True)
        engine["zero_to_fp32"] = get_fp32_state_dict_from_zero_checkpoint(root)
        for state, tensors in engine.items():
            want = from_peft_keys(tensors, tuple(lora["targets"]), config, name)
            got = full.optim["master" if state == "zero_to_fp32" else state]
            assert set(got) == set(want) and len(want) == 2 * 7 * config.num_layers
            for tensor_name, tensor in want.items():
                assert torch.equal(got[tensor_name], tensor), (name, state, tensor_name)
        assert set(full.weights) == set(base.weights) | set(full.optim["master"])
        for tensor_name, tensor in base.weights.items():
            assert torch.equal(full.weights[tensor_name], tensor), (name, tensor_name)
        assert int(full.scalars["applied_steps"]) == full.meta["iteration"] == TRAIN_STEPS
        assert full.meta["consumed_samples"] == TRAIN_STEPS * MICRO * WORLD
        saved = record(deepspeed_run, name)
        torch.testing.assert_close(megazoo_logits(lora_imported[name], IDS),
                                   torch.tensor(saved["logits"]), **FP32)
        assert len(megazoo_next[name]) == len(saved["next"]) == NEXT_STEPS
        torch.testing.assert_close(torch.tensor(megazoo_next[name]), torch.tensor(saved["next"]),
                                   **LOSS)
        with_base = read_full_state(import_checkpoint(  # the base from frozen_param_fragments
            "deepspeed", os.path.join(deepspeed_run, name + "-with-base"), str(tmp_path / name),
            hf_config=hf))
        _assert_same_state(with_base, full, name)
        assert set(with_base.weights) == set(full.weights) and with_base.meta["lora"] == lora
        for tensor_name, tensor in full.weights.items():
            assert torch.equal(with_base.weights[tensor_name], tensor), (name, tensor_name)
    root = checkpoint_root(deepspeed_run, LORA_CASES[0])
    with pytest.raises(CheckpointError, match=r"holds the adapters, not the base model; pass "
                                              r"--hf-config"):
        import_checkpoint("deepspeed", root, str(tmp_path / "no-base"))
    bare = tmp_path / "bare"  # DeepSpeed's files without PEFT's adapter_config.json
    shutil.copytree(root, bare, ignore=shutil.ignore_patterns("adapter_config.json"))
    with pytest.raises(CheckpointError, match=r"needs the adapter_config.json PEFT saved beside "
                                              r"it .* copy it into"):
        import_checkpoint("deepspeed", str(bare), str(tmp_path / "no-config"),
                          hf_config=os.path.join(deepspeed_run, LORA_CASES[0] + "-hf"))
