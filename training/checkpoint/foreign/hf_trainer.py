"""The Hugging Face Trainer's (and TRL's trainers') `checkpoint-N/` folders, continued in megazoo.

    checkpoint-N/config.json, model.safetensors (or sharded), tokenizer files   the model
    checkpoint-N/optimizer.pt        torch AdamW state_dict (hf_trainer_optim.py maps its ids)
    checkpoint-N/scheduler.pt        LambdaLR's state: last_epoch, base_lrs, _last_lr
    checkpoint-N/trainer_state.json  global_step, log_history, train_batch_size, ...
    checkpoint-N/training_args.bin   a pickled TrainingArguments: never read (unpickling runs code)
    checkpoint-N/scaler.pt           fp16 runs: torch GradScaler's state (scale, growth tracker)
    checkpoint-N/rng_state*.pth      not carried: megazoo seeds its own generators

The model is read as a Hugging Face folder (hf.py). The Trainer trains the weights it saved:
in fp32, and with `bf16=True`/`fp16=True` too (autocast keeps the parameters fp32), so the saved
weights are the fp32 masters; a model loaded in bf16 and trained so has no fp32 copy, and its
bf16 weights become the masters (said once). Adam's moments map through the family's
`from_hf_state_dict` like the weights; the step count becomes `applied_steps`, `global_step` the
iteration. trainer_state.json records the per-device batch, not the global one (that needs the
gradient accumulation and the process count, which live in training_args.bin), so the consumed
samples come from `--consumed-samples`, or the import is refused. The learning-rate schedule is
megazoo's command line's: the scheduler's state is logged with the flags that continue it.
An fp16 run's `scaler.pt` (read with weights_only) becomes megazoo's dynamic loss scaler state:
the scale and the growth tracker carry as they are (both count clean steps and grow at the
window), the hysteresis is 1 (GradScaler lowers the scale on every overflow); the flags that
match GradScaler's settings are logged.

Refused in one line: FSDP and DeepSpeed folders (DeepSpeed: `--format deepspeed`), PEFT adapter
folders, optimizers other than torch Adam/AdamW, a save without optimizer.pt.
"""
from __future__ import annotations

import json
import logging
import os

import torch

from megazoo.parallel.layout import ParallelConfig

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import hf_trainer_optim, safe_load
from megazoo.training.checkpoint.layout_writer import write_layout

logger = logging.getLogger(__name__)

STATE, OPTIMIZER, SCHEDULER = "trainer_state.json", "optimizer.pt", "scheduler.pt"
SCALER = "scaler.pt"


def is_trainer_folder(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, n)) for n in (STATE, OPTIMIZER))


def _refuse_other_savers(folder: str) -> None:
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if not names:
        raise ckpt.CheckpointError(f"{folder}: not a folder; pass the Trainer's "
                                   f"output_dir/checkpoint-N")
    runs = sorted((n for n in names if n.startswith("checkpoint-")), key=lambda n: n[11:].zfill(12))
    if runs and STATE not in names:
        raise ckpt.CheckpointError(f"{folder} is a Trainer output_dir; pass one of its "
                                   f"checkpoint folders, e.g. {os.path.join(folder, runs[-1])}")
    if "latest" in names or any(n.startswith("global_step") for n in names):
        raise ckpt.CheckpointError(f"{folder}: a Trainer run under DeepSpeed (its optimizer is in "
                                   f"global_step*/); import it with --format deepspeed")
    if any(n.startswith(("pytorch_model_fsdp", "optimizer_0", "model_0")) for n in names):
        raise ckpt.CheckpointError(f"{folder}: a Trainer run under FSDP, whose sharded optimizer "
                                   f"megazoo does not read; import the weights (a "
                                   f"save_pretrained folder) with --format hf and --finetune")
    if "adapter_config.json" in names:
        raise ckpt.CheckpointError(f"{folder}: a PEFT adapter checkpoint (adapter_config.json); "
                                   f"import the base model with --format hf and load the adapters "
                                   f"with --lora-init (Adam's state of the adapters is not read)")
    for need in (STATE, OPTIMIZER):
        if need not in names:
            raise ckpt.CheckpointError(f"{folder}: no {need} (saved with save_only_model?); "
                                       f"import the weights with --format hf")


def model_config(folder: str):
    """The model of a Trainer checkpoint-N folder (other savers' folders refused first)."""
    from megazoo.training.checkpoint.hf import hf_model_config
    _refuse_other_savers(os.path.normpath(folder))
    return hf_model_config(folder)


def trainer_state(folder: str) -> dict:
    path = os.path.join(folder, STATE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"{path}: unreadable ({e}); it is not the Trainer's "
                                   f"trainer_state.json") from None
    return state


def _schedule(folder: str, state: dict, osd: dict) -> None:
    """Log the Trainer's learning rate and the megazoo flags that continue it (megazoo's
    learning rate is always its command line's)."""
    path = os.path.join(folder, SCHEDULER)
    flags = " ".join(f"{k} {v:g}" for k, v in hf_trainer_optim.hyperparameters(osd).items())
    base = osd["param_groups"][0].get("initial_lr", osd["param_groups"][0]["lr"])
    logged = [h["learning_rate"] for h in state.get("log_history", []) if "learning_rate" in h]
    sched = None
    if os.path.isfile(path):
        try:
            sched = safe_load.load(path)
        except Exception as e:  # noqa: BLE001 - a scheduler we cannot read safely: said, not fatal
            logger.warning("%s: not read (%s); the schedule below comes from optimizer.pt", path,
                           str(e).splitlines()[0][:120])
    if isinstance(sched, dict):
        base = (sched.get("base_lrs") or [base])[0]
        current = (sched.get("_last_lr") or [osd["param_groups"][0]["lr"]])[0]
        at = sched.get("last_epoch")
    else:
        current, at = osd["param_groups"][0]["lr"], state["global_step"]
    constant = current == base and all(lr == base for lr in logged)
    logger.info("%s: the Trainer's schedule stood at step %s with base lr %g, next lr %g (%s); "
                "continue with --lr %g %s %s", folder, at, base, current,
                "constant" if constant else "decaying: its kind and warmup are in "
                "training_args.bin, which is not read", base,
                "--lr-decay-style constant" if constant else
                "--lr-decay-style linear|cosine --lr-warmup-iters W --lr-decay-iters N "
                "--min-lr 0 (as the Trainer's lr_scheduler_type, warmup_steps, max_steps)",
                f"{flags} --clip-grad as its max_grad_norm (the Trainer's default: 1.0)")


def scaler_scalars(folder: str) -> dict[str, torch.Tensor]:
    """The `scaler.*` scalars of megazoo's optimizer state from the Trainer's scaler.pt (torch
    GradScaler.state_dict(); empty when there is none or the scaler was disabled)."""
    path = os.path.join(folder, SCALER)
    if not os.path.isfile(path):
        return {}
    sd = safe_load.load(path)
    if not sd:
        return {}
    try:
        scale, tracker = float(sd["scale"]), int(sd["_growth_tracker"])
        window = int(sd["growth_interval"])
        factors = float(sd["growth_factor"]), float(sd["backoff_factor"])
    except (KeyError, TypeError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}: not torch GradScaler's state_dict ({e!r} missing or "
                                   f"malformed); move it away to import without the loss "
                                   f"scale") from None
    logger.info("%s: the Trainer's fp16 loss scale %g (growth tracker %d) carried over; resume "
                "with --fp16 --loss-scale-window %d --hysteresis 1 as its GradScaler", path, scale,
                tracker, window)
    if factors != (2.0, 0.5):
        logger.warning("%s: GradScaler's growth / backoff factors %g / %g; megazoo grows by 2 "
                       "and lowers by 0.5", path, *factors)
    return {"scaler.loss_scale": torch.tensor(scale, dtype=torch.float64),
            "scaler.growth_tracker": torch.tensor(tracker),
            "scaler.hysteresis_tracker": torch.tensor(1)}


def read(folder: str, *, optimizer: bool = True, consumed_samples: int | None = None):
    """(family, config, FullState, iteration) of a Trainer checkpoint-N folder."""
    from megazoo.training.checkpoint.hf import hf_to_full, read_hf_config
    folder = os.path.normpath(folder)
    _refuse_other_savers(folder)
    state = trainer_state(folder)
    step = int(state["global_step"])
    if optimizer and consumed_samples is None:
        per = state.get("train_batch_size")
        raise ckpt.CheckpointError(
            f"{folder}/{STATE} records global_step={step} and the per-device batch "
            f"(train_batch_size={per}), not the samples consumed; pass --consumed-samples "
            f"(global_step x batch x gradient_accumulation_steps x processes"
            + (f", e.g. {step * per} for one process without accumulation)" if per else ")"))
    parsed = read_hf_config(folder)
    model_type, config, full = hf_to_full(folder, parsed)
    full.meta.update(consumed_samples=int(consumed_samples or 0), skipped_steps=0,
                     source=dict(format="hf-trainer", folder=os.path.abspath(folder)))
    if not optimizer:
        return model_type, config, full, step
    osd = safe_load.load(os.path.join(folder, OPTIMIZER))
    moments, applied = hf_trainer_optim.named_states(osd, parsed[2],
                                                     os.path.join(folder, OPTIMIZER))
    module = parsed[1]
    optim = {k: {n: t.float() for n, t in module.from_hf_state_dict(v, config).items()}
             for k, v in moments.items()}
    if full.meta["hf_config"].get("dtype") not in (None, "float32"):
        logger.warning("%s: the weights are %s: the Trainer trained them so (no fp32 copy); "
                       "they become the fp32 masters", folder, full.meta["hf_config"]["dtype"])
    optim["master"] = dict(full.weights)
    if set(optim["master"]) != set(optim["exp_avg"]):
        raise ckpt.CheckpointError(f"{folder}: the optimizer's parameters map to "
                                   f"{len(optim['exp_avg'])} tensors, the weights to "
                                   f"{len(optim['master'])}; they are not the same model")
    if applied != step:
        logger.info("%s: Adam took %d steps in %d iterations (skipped steps)", folder, applied,
                    step)
    full.meta["skipped_steps"] = max(step - applied, 0)
    _schedule(folder, state, osd)
    logger.info("%s: rng_state*.pth not carried (megazoo seeds its own generators); "
                "training_args.bin not read", folder)
    full.optim.update(optim)
    full.scalars.update(iteration=torch.tensor(step), applied_steps=torch.tensor(applied),
                        **scaler_scalars(folder))
    return model_type, config, full, step


def import_hf_trainer(folder: str, save: str, *, parallel: ParallelConfig | None = None,
                      dp: int = 1, zero_stage: int = 0, optimizer: bool = True,
                      consumed_samples: int | None = None, **sizes) -> str:
    """Convert a Trainer checkpoint-N folder into a megazoo checkpoint for the layout `parallel`
    (or its `sizes`) x `dp`, with Adam's state unless `optimizer` is False; the tokenizer files
    travel as with --format hf."""
    from megazoo.training.checkpoint.hf import save_tokenizer
    parallel = ParallelConfig.of(parallel, **sizes)
    parallel.validate(parallel.tp * parallel.pp * parallel.cp * dp)
    model_config(folder).check_layout(parallel)  # before any tensor is read
    name, config, full, step = read(folder, optimizer=optimizer, consumed_samples=consumed_samples)
    out = write_layout(full, save, config=config, parallel=parallel, dp=dp, zero_stage=zero_stage,
                       iteration=step, weights_only=not optimizer)
    copied = save_tokenizer(folder, save, full.meta)
    logger.info("imported %s (hf-trainer, %s) into %s at %s dp=%d, iteration %d, %s; tokenizer "
                "files: %s", folder, name, out, parallel, dp, step,
                "with Adam's state" if optimizer else "weights only", copied or "none")
    return out
