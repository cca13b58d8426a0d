"""The Hugging Face Trainer's checkpoint-N folders (with optimizer.pt) continue in megazoo.

transformers' own Trainer trains a tiny Llama (hidden 32, 2 layers, tied embeddings) for 3 steps
on CPU in fp32 (AdamW, weight decay 0.1 on its decay group, a constant learning rate, gradient
clipping at its default 1.0) and saves checkpoint-1..3. checkpoint-2 imported at tp=2 has the
Trainer's logits, its Adam moments bit for bit (taken from the live optimizer by parameter
object, not by the file's ids), its weights as fp32 masters, step and iteration 2; megazoo's
resumed step at tp=2 on the batch the Trainer used for step 3 gives its step-3 loss and
checkpoint-3's weights. Folders of other savers and other optimizers are refused in one line.
"""
import json
import os
import shutil

import pytest
import torch

from tests.distributed import run_distributed
from tests.foreign_checkpoints import FP32, megazoo_logits
from tests.tolerances import assert_trained_close

LR, DECAY, SEQ, BATCH, STEPS = 1e-2, 0.1, 17, 2, 3


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """output_dir with checkpoint-1..3, the batches each step used, the moments at step 2 by
    name, and the Trainer's logged losses."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)
    out = str(tmp_path_factory.mktemp("hf-trainer"))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 64, (SEQ,), generator=g)} for _ in range(BATCH * STEPS)]
    batches, moments = [], {}

    def collate(rows):  # called in step order (no workers)
        ids = torch.stack([r["input_ids"] for r in rows])
        batches.append(ids.clone())
        return {"input_ids": ids, "labels": ids.clone()}

    class Moments(TrainerCallback):
        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 2:
                moments.update({n: {k: v.clone() for k, v in optimizer.state[p].items()}
                                for n, p in model.named_parameters()})

    args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=1,
                             per_device_train_batch_size=BATCH, learning_rate=LR,
                             lr_scheduler_type="constant", weight_decay=DECAY, report_to=[],
                             use_cpu=True, logging_steps=1, seed=3, dataloader_num_workers=0,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
            callbacks=[Moments()]).train()
    with open(os.path.join(out, "checkpoint-3", "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    return out, batches, moments, losses


@pytest.fixture(scope="module")
def imported(trainer_run, tmp_path_factory):
    """checkpoint-2 through the converter's command line, at tp=2."""
    from tests.tool_runs import tool_output
    out = trainer_run[0]
    rc, printed, err = tool_output("convert_checkpoint", "import", "--format", "hf-trainer",
                                   "--load", os.path.join(out, "checkpoint-2"), "--save",
                                   tmp_path_factory.mktemp("mz") / "run",
                                   "--tensor-model-parallel-size", 2,
                                   "--consumed-samples", 2 * BATCH)
    assert rc == 0, err
    return printed.strip()


def _hf_weights(folder):
    from safetensors.torch import load_file

    from megazoo.models.llama import adapter as llama
    from megazoo.training.checkpoint.hf import hf_model_config
    return llama.from_hf_state_dict(load_file(os.path.join(folder, "model.safetensors")),
                                    hf_model_config(folder))


def test_checkpoint_imports_with_the_trainers_state(trainer_run, imported):
    from transformers import LlamaForCausalLM

    from megazoo.models.llama import adapter as llama
    from megazoo.training.checkpoint.hf import hf_model_config
    from megazoo.training.checkpoint.reshard import read_full_state
    out, batches, moments, _ = trainer_run
    ckpt2 = os.path.join(out, "checkpoint-2")
    assert len(batches) == STEPS and len(moments) == 20  # tied: the embedding once
    hf = LlamaForCausalLM.from_pretrained(ckpt2).eval()
    with torch.no_grad():
        want = hf(batches[0]).logits
    torch.testing.assert_close(megazoo_logits(imported, batches[0]), want, **FP32)
    full = read_full_state(imported)
    config = hf_model_config(ckpt2)
    for state in ("exp_avg", "exp_avg_sq"):
        live = llama.from_hf_state_dict({n: s[state] for n, s in moments.items()}, config)
        assert set(live) == set(full.optim[state])
        for name, t in live.items():
            assert torch.equal(full.optim[state][name], t), (state, name)
    weights = _hf_weights(ckpt2)
    for name, t in weights.items():
        assert torch.equal(full.optim["master"][name], t), name
    assert {int(s["step"]) for s in moments.values()} == {2}
    assert int(full.scalars["applied_steps"]) == 2 and int(full.scalars["iteration"]) == 2
    assert full.meta["iteration"] == 2 and full.meta["consumed_samples"] == 2 * BATCH
    assert full.meta["source"]["format"] == "hf-trainer"


def _resume(rank, folder, ids):
    """megazoo continues the imported run at tp=2 for one step on `ids`: (loss, full params)."""
    torch.set_num_threads(1)
    from megazoo.models.registry import build_model
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.checkpoint import reshard
    from megazoo.training.checkpoint.hf import checkpoint_config
    from tests.helpers import full_model_parameters
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    _, config = checkpoint_config(folder)
    model = build_model(config, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                                       weight_decay=DECAY, clip_grad=1.0),
                          torch.float32)
    reshard.load_into(reshard.read_full_state(folder), [model], opt, topo,
                      weights_only=False, folder=folder)
    assert opt.applied_steps == 2 and opt.iteration == 2
    loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
    opt.backward(loss)
    opt.step()
    return loss.item(), full_model_parameters(model, opt, topo)


def test_megazoo_continues_with_the_trainers_step_3(trainer_run, imported):
    out, batches, _, losses = trainer_run
    ranks = run_distributed(_resume, 2, imported, batches[2])
    loss, params = ranks[0]
    assert loss == pytest.approx(losses[2], rel=1e-5)  # the Trainer logs step 3's loss
    want = _hf_weights(os.path.join(out, "checkpoint-3"))
    before = _hf_weights(os.path.join(out, "checkpoint-2"))
    got = {k: v for k, v in params.items() if k in want}
    assert set(got) == set(want)
    assert_trained_close(got, want, before, "hf-trainer resume at tp=2", LR)


def _variant(src, dst, edit=None, **files):
    shutil.copytree(src, dst)
    for name, content in files.items():
        with open(os.path.join(dst, name.replace("__", ".")), "w") as f:
            f.write(content)
    if edit is not None:
        path = os.path.join(dst, "optimizer.pt")
        osd = torch.load(path, weights_only=True)
        edit(osd)
        torch.save(osd, path)
    return dst


def _without(src, dst, name):
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, name))
    return dst


def _sgd(osd):
    for st in osd["state"].values():
        st.clear()
        st["momentum_buffer"] = torch.zeros(1)


def _amsgrad(osd):
    osd["param_groups"][1]["amsgrad"] = True


def _adam_l2(osd):
    osd["param_groups"][0]["decoupled_weight_decay"] = False


def _regroup(osd):
    first, second = osd["param_groups"]
    second["params"].insert(0, first["params"].pop())


def test_other_folders_and_optimizers_are_refused(trainer_run, tmp_path, caplog):
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.foreign.hf_trainer import read
    from tests.tool_runs import tool_module
    out = trainer_run[0]
    ckpt2 = os.path.join(out, "checkpoint-2")
    cases = [
        (ckpt2, {}, "pass --consumed-samples (global_step x batch x gradient_accumulation_steps "
                    "x processes, e.g. 4 for one process"),
        (out, {"consumed_samples": 4}, "pass one of its checkpoint folders, e.g. "
                                       + os.path.join(out, "checkpoint-3")),
        (_variant(ckpt2, tmp_path / "ds", latest="global_step2"), {"consumed_samples": 4},
         "import it with --format deepspeed"),
        (_variant(ckpt2, tmp_path / "peft", adapter_config__json="{}"), {"consumed_samples": 4},
         "a PEFT adapter checkpoint (adapter_config.json)"),
        (_variant(ckpt2, tmp_path / "sgd", _sgd), {"consumed_samples": 4},
         "megazoo continues torch Adam/AdamW only"),
        (_variant(ckpt2, tmp_path / "amsgrad", _amsgrad), {"consumed_samples": 4},
         "AdamW with amsgrad/maximize"),
        (_variant(ckpt2, tmp_path / "l2", _adam_l2), {"consumed_samples": 4},
         "torch Adam with weight_decay=0.1 (L2 in the gradient"),
        (_variant(ckpt2, tmp_path / "fsdp", pytorch_model_fsdp_0="x"), {"consumed_samples": 4},
         "a Trainer run under FSDP"),
        (_without(ckpt2, tmp_path / "weights-only", "optimizer.pt"), {"consumed_samples": 4},
         "no optimizer.pt (saved with save_only_model?)"),
        (_variant(ckpt2, tmp_path / "groups", _regroup), {"consumed_samples": 4},
         "the optimizer's groups hold [14, 6] parameters, the Trainer's decay / no-decay groups "
         "of this config.json [15, 5]"),
    ]
    for folder, kw, message in cases:
        with pytest.raises(CheckpointError) as e:
            read(str(folder), **kw)
        assert message in str(e.value) and "\n" not in str(e.value), (folder, str(e.value))
    tool = tool_module("convert_checkpoint")
    a = tool.build_parser().parse_args(["import", "--format", "hf", "--load", ckpt2, "--save",
                                        str(tmp_path / "weights"), "--consumed-samples", "4"])
    with pytest.raises(ValueError, match="--consumed-samples applies to --format hf-trainer"):
        tool.convert(a)
    a.consumed_samples = None
    with caplog.at_level("INFO"):
        tool.convert(a)
    assert "--format hf-trainer carries its AdamW state" in caplog.text


def _grad_scaler_steps(scaler, overflows):
    """torch's GradScaler (the Trainer's fp16 scaler) through steps, an inf gradient where
    `overflows` says: the scale after each step."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for inf in overflows:
        scaler.scale(p.sum()).backward()
        if inf:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_fp16_loss_scale_carries(trainer_run, tmp_path, caplog):
    """The Trainer's scaler.pt (torch GradScaler's own state_dict) becomes megazoo's scaler
    state: resumed with the logged flags, megazoo's scale follows GradScaler's step for step
    across growths and overflows. A scaler.pt of another shape is refused in one line."""
    from megazoo.parallel.zero.config import LossScaleConfig
    from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
    from megazoo.training.checkpoint.format import CheckpointError
    from megazoo.training.checkpoint.foreign.hf_trainer import read
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    _grad_scaler_steps(scaler, [False, False, False, True, False])  # grew, lowered, 1 clean
    ckpt = _variant(os.path.join(trainer_run[0], "checkpoint-2"), tmp_path / "fp16")
    torch.save(scaler.state_dict(), os.path.join(ckpt, "scaler.pt"))
    with caplog.at_level("INFO"):
        full = read(str(ckpt), consumed_samples=4)[2]
    assert "--fp16 --loss-scale-window 3 --hysteresis 1" in caplog.text
    ours = DynamicLossScaler(LossScaleConfig(initial_scale=1.0, growth_interval=3, hysteresis=1))
    ours.load_state_dict({k[len("scaler."):]: v for k, v in full.scalars.items()
                          if k.startswith("scaler.")})
    assert ours.scale == scaler.get_scale() == 2.0 ** 10
    then = [False, False, False, True, True, False, False, False, False]
    want, got = _grad_scaler_steps(scaler, then), []
    for inf in then:
        ours.update(inf)
        got.append(ours.scale)
    assert got == want and len(set(want)) > 2, (got, want)
    torch.save({"scale": 2.0}, os.path.join(ckpt, "scaler.pt"))
    with pytest.raises(CheckpointError, match="not torch GradScaler's state_dict") as e:
        read(str(ckpt), consumed_samples=4)
    assert "\n" not in str(e.value)
