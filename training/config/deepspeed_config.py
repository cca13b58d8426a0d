"""A DeepSpeed config JSON (`--deepspeed_config FILE`), read into the flags it stands for.

Every key is modelled or refused: a key that sets something megazoo has becomes that flag's value
(refused, naming both, where the command line gives the flag another value); a key that tunes
what megazoo does its own way is accepted with one log line; any other key is refused.
Megatron-DeepSpeed hands both the flags and this file to DeepSpeed, which trains with the file's
optimizer and precision, so the file decides where the command line is silent.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# DeepSpeed key -> what megazoo does instead (accepted, one log line each).
TUNING = {
    "steps_per_print": "megazoo logs every --log-interval iterations",
    "wall_clock_breakdown": "megazoo's log line carries ms per iteration; no per-phase breakdown",
    "dump_state": "megazoo writes the run's resolved config to its journal (--save)",
    "prescale_gradients": "megazoo averages gradients in fp32 after the reduction",
    "gradient_predivide_factor": "megazoo averages gradients in fp32 after the reduction",
    "zero_allow_untested_optimizer": "megazoo's ZeRO shards its own AdamW/SGD",
    "zero_force_ds_cpu_optimizer": "megazoo's offload steps its own CPU AdamW",
    "memory_breakdown": "megazoo logs the peak memory (mem_gib) every --log-interval",
    "flops_profiler": "megazoo logs TFLOP/s per rank and MFU from the model's FLOP count",
    "comms_logger": "megazoo has no communication logger; --collective-timeout names hung ranks",
}
ZERO_TUNING = {
    "overlap_comm": "megazoo always overlaps the gradient reduction with backward",
    "contiguous_gradients": "megazoo keeps gradients in flat contiguous buffers always",
    "allgather_partitions": "megazoo all-gathers ZeRO-1/2 parameters after the step",
    "allgather_bucket_size": "megazoo all-gathers each flat buffer whole",
    "reduce_scatter": "megazoo reduce-scatters ZeRO-2/3 gradients always",
    "round_robin_gradients": "megazoo shards each flat buffer evenly over data parallelism",
    "stage3_prefetch_bucket_size": "ZeRO-3 prefetches one layer ahead",
    "stage3_param_persistence_threshold": "ZeRO-3 shards every parameter",
    "stage3_max_live_parameters": "ZeRO-3 holds one layer gathered plus the prefetched one",
    "stage3_max_reuse_distance": "ZeRO-3 frees a layer's gathered weights after its use",
    "stage3_gather_16bit_weights_on_model_save": "megazoo's checkpoints hold whole tensors always",
    "sub_group_size": "megazoo steps each flat buffer's shard as one group",
    "elastic_checkpoint": "megazoo's checkpoints load at any layout (resharded on load)",
    "ignore_unused_parameters": "every megazoo parameter receives a gradient",
    "load_from_fp32_weights": "megazoo restores the fp32 masters from the checkpoint always",
    "memory_efficient_linear": "megazoo's linear layers save only their inputs",
}
ACTIVATION_TUNING = {
    "partition_activations": "megazoo's recompute keeps each recomputed layer's input "
                             "(sharded over tensor parallelism with --sequence-parallel)",
    "contiguous_memory_optimization": "megazoo's recompute keeps layer inputs as ordinary tensors",
    "cpu_checkpointing": "megazoo keeps recompute inputs on the device",
    "number_checkpoints": "--recompute-num-layers sets what is recomputed",
    "synchronize_checkpoint_boundary": "megazoo's recompute needs no synchronisation",
    "profile": "megazoo does not time recomputation separately",
}
_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}  # DeepSpeed's Adam is AdamW by default
_OFFLOAD = {"none": "none", "cpu": "cpu", "nvme": "nvme"}


class DeepSpeedConfigError(ValueError):
    """The file cannot be read; the message names it."""


@dataclass
class DeepSpeedSettings:
    """What the file sets: flag values by argparse dest, log lines, and refused keys."""

    values: dict = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    gradient_accumulation_steps: int | None = None  # checked against dp once the world is known


def read_deepspeed_config(path: str) -> DeepSpeedSettings:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: not a JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: expected a JSON object")
    return DeepSpeedReader(path).read(cfg)


class DeepSpeedReader:
    def __init__(self, path: str):
        self.path, self.out = path, DeepSpeedSettings()

    def _where(self, key: str) -> str:
        return f"--deepspeed_config {self.path}: {key}"

    def refuse(self, key: str, why: str) -> None:
        self.out.refused.append(f"{self._where(key)}: {why}")

    def accept(self, key: str, why: str) -> None:
        self.out.accepted.append(f"{self._where(key)}: {why}")

    def set(self, dest: str, value) -> None:
        if value != "auto":  # HF-style "auto": the command line decides
            self.out.values[dest] = value

    def read(self, cfg: dict) -> DeepSpeedSettings:
        handlers = {
            "train_micro_batch_size_per_gpu": lambda v: self.set("micro_batch_size", v),
            "train_batch_size": lambda v: self.set("global_batch_size", v),
            "gradient_accumulation_steps": self._accumulation,
            "gradient_clipping": lambda v: self.set("clip_grad", float(v)),
            "zero_optimization": self._zero,
            "fp16": lambda v: self._precision("fp16", v),
            "bf16": lambda v: self._precision("bf16", v),
            "bfloat16": lambda v: self._precision("bf16", v),
            "optimizer": self._optimizer,
            "scheduler": lambda v: self.refuse(
                "scheduler", "megazoo's schedule is Megatron's: drop the section and give "
                "--lr-warmup-iters/--lr-warmup-samples, --lr-decay-style, --lr-decay-iters, --min-lr"),
            "activation_checkpointing": self._activations,
            "data_types": self._data_types,
            "communication_data_type": self._communication_dtype,
            "tensorboard": lambda v: self._writer("tensorboard", v, "output_path", "tensorboard_dir"),
            "wandb": lambda v: self._writer("wandb", v, "project", "wandb_project"),
        }
        for key, value in cfg.items():
            if key in handlers:
                handlers[key](value)
            elif key in TUNING:
                self.accept(key, TUNING[key])
            else:
                self.refuse(key, "not a setting megazoo models; remove it (docs/megatron.md lists "
                            "the DeepSpeed keys megazoo reads)")
        return self.out

    def _accumulation(self, value) -> None:
        if value != "auto":
            self.out.gradient_accumulation_steps = int(value)

    def _zero(self, zero: dict) -> None:
        for key, value in zero.items():
            name = f"zero_optimization.{key}"
            if key == "stage":
                self.set("zero_stage", int(value))
            elif key in ("offload_optimizer", "cpu_offload"):
                device = (value.get("device", "none") if isinstance(value, dict)
                          else "cpu" if value else "none")
                if device not in _OFFLOAD:
                    self.refuse(name, f"device {device!r}: megazoo offloads to cpu or nvme")
                    continue
                self.set("offload_optimizer", _OFFLOAD[device])
                if isinstance(value, dict) and value.get("nvme_path"):
                    self.set("offload_dir", value["nvme_path"])
                extra = sorted(set(value) - {"device", "nvme_path"}) if isinstance(value, dict) else []
                if extra:
                    self.accept(f"{name}.{','.join(extra)}", "megazoo's offload sets its own "
                                "buffering (pinned memory, two buckets resident)")
            elif key == "offload_param":
                device = value.get("device", "none") if isinstance(value, dict) else "none"
                if device != "none":
                    self.refuse(name, f"device {device!r}: megazoo offloads optimizer states, not "
                                "parameters; use offload_optimizer (--offload-optimizer) with "
                                "stage 3")
            elif key == "reduce_bucket_size":
                self.set("ddp_bucket_size", int(float(value)))
            elif key in ZERO_TUNING:
                self.accept(name, ZERO_TUNING[key])
            else:
                self.refuse(name, "not a ZeRO setting megazoo models; remove it")

    def _precision(self, kind: str, section: dict) -> None:
        enabled = section.get("enabled", True)
        if enabled == "auto":
            return
        self.set(kind, bool(enabled))
        for key, value in section.items():
            name = f"{kind}.{key}"
            if key == "enabled":
                continue
            if kind == "bf16" and key == "immediate_grad_update":
                self.accept(name, "megazoo steps once per global batch")
            elif kind != "fp16":
                self.refuse(name, "not a bf16 setting megazoo models; remove it")
            elif key == "loss_scale":  # 0: dynamic
                if float(value) > 0:
                    self.set("loss_scale", float(value))
            elif key == "initial_scale_power":
                self.set("initial_loss_scale", 2.0 ** int(value))
            elif key == "loss_scale_window":
                self.set("loss_scale_window", int(value))
            elif key == "hysteresis":
                self.set("hysteresis", int(value))
            elif key == "min_loss_scale":
                self.set("min_loss_scale", float(value))
            elif key in ("auto_cast", "consecutive_hysteresis"):
                self.refuse(name, "megazoo's fp16 keeps Megatron's semantics (no autocast, "
                            "hysteresis resets on a clean step); remove it")
            else:
                self.refuse(name, "not an fp16 setting megazoo models; remove it")

    def _optimizer(self, section: dict) -> None:
        kind = str(section.get("type", "")).lower()
        if kind not in _OPTIMIZERS:
            self.refuse("optimizer.type", f"{section.get('type')!r}: megazoo has AdamW (DeepSpeed's "
                        f"Adam, adam_w_mode) and SGD; use --optimizer adamw|sgd")
            return
        params = section.get("params", {})
        if kind == "adam" and params.get("adam_w_mode", True) is False:
            self.refuse("optimizer.params.adam_w_mode", "false (L2 in the gradient): megazoo's Adam "
                        "decouples weight decay (AdamW); remove it")
        self.set("optimizer", _OPTIMIZERS[kind])
        for key, value in params.items():
            name = f"optimizer.params.{key}"
            if key == "lr":
                self.set("lr", float(value))
            elif key == "betas":
                if value != "auto":
                    self.set("adam_beta1", float(value[0]))
                    self.set("adam_beta2", float(value[1]))
            elif key == "eps":
                self.set("adam_eps", float(value))
            elif key == "weight_decay":
                self.set("weight_decay", float(value))
            elif key == "momentum" and kind == "sgd":
                self.refuse(name, "megazoo's SGD has no --momentum flag yet; remove it")
            elif key in ("adam_w_mode", "torch_adam", "fused"):
                if key != "adam_w_mode":
                    self.accept(name, "megazoo picks its own AdamW kernel; the update is the same")
            else:
                self.refuse(name, "not an optimizer setting megazoo models; remove it")

    def _activations(self, section: dict) -> None:
        for key in section:
            name = f"activation_checkpointing.{key}"
            if key in ACTIVATION_TUNING:
                self.accept(name, ACTIVATION_TUNING[key])
            else:
                self.refuse(name, "not an activation-checkpointing setting megazoo models; remove it")

    def _data_types(self, section: dict) -> None:
        for key, value in section.items():
            if key == "grad_accum_dtype" and str(value) in ("fp32", "bf16"):
                self.set("grad_reduce_in_bf16", str(value) == "bf16")
            elif key == "grad_accum_dtype":
                self.refuse("data_types.grad_accum_dtype", f"{value!r}: megazoo accumulates "
                            "gradients in fp32, or in bf16 with --bf16 (--grad-reduce-in-bf16)")
            else:
                self.refuse(f"data_types.{key}", "not a data type megazoo models; remove it")

    def _communication_dtype(self, value) -> None:
        if str(value) not in ("fp32", "float32"):
            self.refuse("communication_data_type", f"{value!r}: megazoo reduces gradients in their "
                        f"buffer's dtype; use data_types.grad_accum_dtype (or --grad-reduce-in-bf16)")

    def _writer(self, key: str, section: dict, path_key: str, dest: str) -> None:
        if not section.get("enabled", False):
            return
        if section.get(path_key):
            self.set(dest, section[path_key])
        else:
            self.refuse(f"{key}.{path_key}", f"{key} is enabled without a {path_key}; give one")


def contradictions(settings: DeepSpeedSettings, args, given: set[str], flag_of) -> list[str]:
    """Apply the file's values to `args` where the command line is silent; where it gives a flag
    another value, one refusal naming both. `given`: dests set on the command line; `flag_of`:
    dest -> its flag."""
    refused = []
    for dest, value in settings.values.items():
        if dest in ("fp16", "bf16"):
            continue  # precision below: two flags, one choice
        if dest in given and not _same(getattr(args, dest), value):
            refused.append(f"{flag_of(dest)} {getattr(args, dest)} contradicts --deepspeed_config "
                           f"{_json_key(dest)} = {value}; make them agree")
        elif dest not in given:
            setattr(args, dest, value)
    for kind in ("fp16", "bf16"):
        if kind not in settings.values:
            continue
        enabled, flagged = settings.values[kind], getattr(args, kind)
        if enabled and not flagged:
            other = "bf16" if kind == "fp16" else "fp16"
            if getattr(args, other):
                refused.append(f"--{other} contradicts --deepspeed_config {kind}.enabled = true; "
                               f"make them agree")
            else:
                setattr(args, kind, True)
        elif flagged and not enabled:
            refused.append(f"--{kind} contradicts --deepspeed_config {kind}.enabled = false; "
                           f"make them agree")
    return refused


_JSON_KEYS = {"micro_batch_size": "train_micro_batch_size_per_gpu", "global_batch_size": "train_batch_size",
              "clip_grad": "gradient_clipping", "zero_stage": "zero_optimization.stage",
              "offload_optimizer": "zero_optimization.offload_optimizer.device",
              "offload_dir": "zero_optimization.offload_optimizer.nvme_path",
              "ddp_bucket_size": "zero_optimization.reduce_bucket_size", "loss_scale": "fp16.loss_scale",
              "initial_loss_scale": "fp16.initial_scale_power (as 2^power)",
              "loss_scale_window": "fp16.loss_scale_window", "hysteresis": "fp16.hysteresis",
              "min_loss_scale": "fp16.min_loss_scale", "optimizer": "optimizer.type",
              "lr": "optimizer.params.lr", "adam_beta1": "optimizer.params.betas[0]",
              "adam_beta2": "optimizer.params.betas[1]", "adam_eps": "optimizer.params.eps",
              "weight_decay": "optimizer.params.weight_decay", "grad_reduce_in_bf16": "data_types.grad_accum_dtype",
              "tensorboard_dir": "tensorboard.output_path", "wandb_project": "wandb.project"}


def _json_key(dest: str) -> str:
    return _JSON_KEYS.get(dest, dest)


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b
