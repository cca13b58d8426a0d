"""The mixed-precision ZeRO optimizer: what the training loop builds and calls.

    opt = build_optimizer(model_or_chunks, topo, OptimizerConfig(zero_stage=2), dtype=torch.bfloat16)
    for micro in micro_batches[:-1]:
        with opt.no_sync():                     # stages 0-1: accumulate without communicating
            opt.backward(model(micro).mean())
    opt.backward(model(last).mean())            # gradient buckets reduce during this backward
    result = opt.step(loss=loss)                # StepResult(skipped, grad_norm, loss_scale, ...)
    opt.zero_grad()

Building it moves every trainable parameter into flat buckets (see `flat_buffer.py`), casts the
model weights to `dtype` (the model config's, TransformerConfig.dtype) and keeps fp32 master
weights for this rank's shard.
The step: wait for the gradient reductions, compute the global norm (which also detects
overflow), unscale and clip in one multiplier, run AdamW/SGD on each bucket's shard, write the
model-dtype weights and (stages 1-2) all-gather them. Stage 3 leaves the weights sharded; its
hooks gather them layer by layer in the next forward.

"Data parallel" here is data x context parallel (`topo.dp_cp_group`): context-parallel ranks hold
the same parameters and each computed the mean loss of its share of the sequence, so averaging
gradients over dp x cp gives the full batch's gradient, and states are sharded over all of them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import collectives as C
from .clip_grad import clip_coefficient, duplicate_ranges, global_grad_norm
from ..pipeline.partition import chunk_prefix
from .config import OptimizerConfig
from .flat_buffer import FlatBuffer, param_key, plan_buckets
from .grad_sync import GradSync
from .inner import Hyper, build_inner
from .loss_scaler import build_loss_scaler
from .muon import Muon, uses_muon
from .offload import FileStates, build_states
from .qk_clip import QKClip
from .scratch import ScratchPool
from .zero3 import Unit, Zero3Hooks, split_layers

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """The loss or the gradients were NaN/inf at a step (raised when raise_on_nonfinite)."""


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float  # unscaled, before clipping; inf/NaN on an overflowing step
    loss_scale: float  # the scale this step's gradients carried
    iteration: int  # 1-based count of step() calls, skipped ones included
    reason: str = ""


class ZeroOptimizer:
    def __init__(self, modules: list[nn.Module], topo, cfg: OptimizerConfig,
                 dtype: torch.dtype = torch.float32):
        cfg.validate(topo.pp)
        self.cfg, self.topo, self.modules = cfg, topo, modules
        self.dtype = dtype  # the model weights' (and under grad_dtype "model" the gradients')
        self.stage = cfg.zero_stage
        self.lr, self.iteration, self.applied_steps = cfg.lr, 0, 0
        self.inner = build_inner(cfg.optimizer, cfg.betas, cfg.eps, cfg.momentum)
        # --optimizer muon: Muon buckets hold the matrices it suits; AdamW steps the others.
        self.muon = Muon(cfg.muon, topo) if cfg.optimizer == "muon" else None
        self.scaler = build_loss_scaler(dtype, cfg.loss_scale)
        self.mixed = dtype != torch.float32
        self.state_device = topo.device if cfg.offload == "none" else torch.device("cpu")
        # A separate fp32 master copy exists for bf16/fp16, or when the step runs elsewhere.
        self.separate_master = self.mixed or self.state_device != topo.device

        named = [(name, p) for c, m in enumerate(modules) for name, p in _named(m, c, modules)]
        self.param_names = [n for n, _ in named]
        self.muon_ids = {id(p) for n, p in named
                         if self.muon is not None and uses_muon(n, p, cfg.muon)}
        self.units: list[Unit] = []
        self.buffers = self._build_buffers(named)
        # ZeRO-2/3: transient full-gradient buckets, reused across micro-batches and steps
        self.scratch: ScratchPool | None = None
        if self.stage >= 2 and self.buffers:
            self.scratch = ScratchPool(max(b.padded for b in self.buffers),
                                       cfg.grad_torch_dtype(dtype), topo.device)
            for b in self.buffers:
                b.scratch = self.scratch
        specs = [dict(({"master": b.shard_numel} if self.separate_master else {}),
                      **{n: b.shard_numel for n in self._inner_of(b).state_names})
                 for b in self.buffers]
        init = [{"master": b.initial_master} if self.separate_master else {}
                for b in self.buffers]
        for b in self.buffers:
            b.initial_master = None  # the state store adopts it (or writes it to its file)
        self.states = build_states(specs, offload=cfg.offload, device=topo.device,
                                   directory=cfg.offload_dir, rank=topo.rank,
                                   resident=cfg.offload_resident_buckets, init=init)
        del init

        # Rows a TP rank holds as copies of another's (replicated KV heads) count once in norms.
        self.norm_exclusions = {i: r for i, b in enumerate(self.buffers)
                                if (r := duplicate_ranges(b, topo))}
        self.grad_sync = GradSync(self.buffers, stage=self.stage, dp_group=topo.dp_cp_group,
                                  embedding_group=topo.embedding_group,
                                  max_inflight=cfg.max_inflight_buckets)
        self.grad_sync.install_hooks()
        # --qk-clip: the attention layers track their largest logits; the step clips Q/K.
        self.qk_clip = QKClip(cfg.qk_clip, modules, topo) if cfg.qk_clip is not None else None
        self.zero3: Zero3Hooks | None = None
        if self.stage == 3:
            self.zero3 = Zero3Hooks(self.units, prefetch=cfg.zero3_prefetch)
            self.grad_sync.on_launched.append(self.zero3.on_bucket_launched)
            self.zero3.install()
        logger.info("ZeRO-%d optimizer: %d params in %d buckets, %s weights, dp=%d x cp=%d, "
                    "offload=%s", self.stage, self.numel, len(self.buffers), dtype, topo.dp,
                    topo.cp, cfg.offload)

    # ---- construction --------------------------------------------------------------------------
    def _key(self, p):
        return param_key(p, tp_rank=self.topo.tp_rank, is_first_stage=self.topo.is_first_stage,
                         decay_biases_and_norms=self.cfg.decay_biases_and_norms,
                         muon=id(p) in self.muon_ids)

    def _inner_of(self, b: FlatBuffer):
        return self.muon if b.key.muon else self.inner

    def _buffer(self, items, key) -> FlatBuffer:
        # Expert weights differ across the expert-parallel ranks: only the ranks holding the
        # same experts (expert data parallelism) reduce and shard them together.
        group = self.topo.edp_group if key.expert else self.topo.dp_cp_group
        return FlatBuffer(items, key, dtype=self.dtype,
                          grad_dtype=self.cfg.grad_torch_dtype(self.dtype), device=self.topo.device,
                          dp_group=group, dp_rank=C.group_rank(group),
                          sharded=self.stage >= 1, shard_grads=self.stage >= 2,
                          shard_params=self.stage == 3)

    def _build_buffers(self, named) -> list[FlatBuffer]:
        indexed = [(i, n, p) for i, (n, p) in enumerate(named)]
        self.numel = sum(p.numel() for _, _, p in indexed)
        if self.stage < 3:
            # Reverse registration order: roughly the order backward produces gradients.
            return [self._buffer(items, key)
                    for key, items in plan_buckets(indexed[::-1], self._key, self.cfg.bucket_numel)]
        by_param = {id(p): item for item in indexed for p in [item[2]]}
        buffers: list[FlatBuffer] = []
        for r, root in enumerate(self.modules):
            layers = split_layers(root)
            in_layer = {id(p) for layer in layers for p in layer.parameters()}
            groups = [(f"root{r}", root, None,
                       [by_param[id(p)] for p in root.parameters()
                        if id(p) not in in_layer and id(p) in by_param])]
            groups += [(f"root{r}.layer{j}", layer, j,
                        [by_param[id(p)] for p in layer.parameters() if id(p) in by_param])
                       for j, layer in enumerate(layers)]
            for name, module, j, items in groups:
                unit = Unit(name, module, r, j)
                for key, bucket in plan_buckets(items, self._key, self.cfg.bucket_numel):
                    unit.buffers.append(self._buffer(bucket, key))
                buffers += unit.buffers
                self.units.append(unit)
        return buffers

    # ---- the training-loop API -----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    def no_sync(self):
        return self.grad_sync.no_sync()

    def zero_grad(self) -> None:
        for b in self.buffers:
            b.zero_grad()
            for s in b.slots:
                s.param.grad = None

    def step(self, loss: float | torch.Tensor | None = None) -> StepResult:
        self.iteration += 1
        self.grad_sync.finish()
        scale = self.scaler.scale
        norm = global_grad_norm(self.buffers, sharded=self.stage >= 1,
                                dp_group=self.topo.dp_cp_group, mp_group=self.topo.mp_group,
                                ep_group=self.topo.ep_group,
                                device=self.topo.device, exclude=self.norm_exclusions) / scale
        loss_value = float(loss) if loss is not None else None
        if self.qk_clip is not None:
            self.qk_clip.prepare()  # this step's maxima, reset for the next step's forward
        if not math.isfinite(norm) or (loss_value is not None and not math.isfinite(loss_value)):
            if self.qk_clip is not None:
                self.qk_clip.row_scales.clear()  # a skipped step changes no weight
            return self._skip(norm, scale, loss_value)
        mult = clip_coefficient(norm, self.cfg.clip_grad) / scale
        self.applied_steps += 1
        for i, st in self.states.sweep(range(len(self.buffers))):
            b = self.buffers[i]
            hyper = Hyper(self.lr, self.cfg.weight_decay if b.key.decay else 0.0,
                          self.applied_steps)
            grad = b.grad_shard.to(self.state_device, torch.float32)
            # fp32 on the device without offload: the weights' own shard is the master
            master = st["master"] if self.separate_master else \
                b.param_shard if b.shard_params else b.params.data[b.shard_slice]
            if b.key.muon:
                self.muon.update_bucket(b, master, grad, st, hyper, mult)
            else:
                self.inner.update(master, grad, st, hyper, mult)
            if self.qk_clip is not None:
                self.qk_clip.apply(b, master)
            if self.separate_master:
                b.write_params(master)
        for pending in [b.all_gather_params() for b in self.buffers]:
            pending.wait()
        if self.zero3 is not None:
            self.zero3.release_all()  # gathered copies are stale now; re-gather from shards
        self.scaler.update(False)
        return StepResult(False, norm, scale, self.iteration)

    def _skip(self, norm: float, scale: float, loss_value: float | None) -> StepResult:
        what = f"loss {loss_value}" if loss_value is not None and not math.isfinite(loss_value) \
            else f"gradient norm {norm}"
        if self.zero3 is not None:
            self.zero3.release_all()
        if self.scaler.dynamic:
            self.scaler.update(True)
            reason = (f"step {self.iteration}: fp16 overflow ({what}); step skipped, loss scale "
                      f"{scale:g} -> {self.scaler.scale:g}")
            logger.warning(reason)
        else:
            reason = f"step {self.iteration}: non-finite {what}; step skipped"
            logger.error(reason)
            if self.cfg.raise_on_nonfinite:
                raise NonFiniteError(reason)
        return StepResult(True, norm, scale, self.iteration, reason)

    # ---- inspection ----------------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """name -> an fp32 copy of the full (DP-unsharded) parameter; gathers under ZeRO-3."""
        out = {}
        for b in self.buffers:
            was = b.gathered
            b.gather(async_op=False).wait()
            for s in b.slots:
                out[self.param_names[s.index]] = s.param.detach().float().clone()
            if not was:
                b.release()
        return out

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for each kind of model state (padding included)."""
        master = states = 0
        if not isinstance(self.states, FileStates):
            for s in self.states.states:
                for name, t in s.items():
                    master += t.nbytes if name == "master" else 0
                    states += t.nbytes if name != "master" else 0
        report = {
            "numel": self.numel,
            "params": sum(b.param_bytes() for b in self.buffers),
            "grads": sum(b.grad_bytes() for b in self.buffers),
            "master_params": master,
            "optimizer_states": states,
            "offload_resident": self.states.resident_bytes() if isinstance(self.states,
                                                                           FileStates) else 0,
            "offload_files": self.states.total_bytes() if isinstance(self.states,
                                                                     FileStates) else 0,
        }
        report["model_states"] = sum(report[k] for k in ("params", "grads", "master_params",
                                                          "optimizer_states", "offload_resident"))
        # ZeRO-2/3 working buffers kept between steps (the transient gradient buckets' pool,
        # scratch.py): like activations, not model states
        report["grad_scratch"] = self.scratch.held_bytes() if self.scratch is not None else 0
        if self.zero3 is not None:
            report["zero3_peak_gathered"] = self.zero3.peak_gathered_bytes
        return report

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only. Per bucket: its states and `ranges` rows (param index, start, end in the
        parameter's flat numel, offset in this shard) saying which slice of which params it holds."""
        sd: dict[str, torch.Tensor] = {"iteration": torch.tensor(self.iteration),
                                       "applied_steps": torch.tensor(self.applied_steps)}
        sd.update({f"scaler.{k}": v for k, v in self.scaler.state_dict().items()})
        for i, b in enumerate(self.buffers):
            rows = [[s.index, lo - s.offset, hi - s.offset, lo - b.shard_start]
                    for s, lo, hi in b.shard_ranges()]
            sd[f"bucket{i}.ranges"] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
            with self.states.checkout(i) as st:
                for name, t in st.items():
                    sd[f"bucket{i}.{name}"] = _host_copy(t)
            if not self.separate_master:
                master = b.param_shard if b.shard_params else b.params.data[b.shard_slice]
                sd[f"bucket{i}.master"] = _host_copy(master.float())
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a state_dict written with the same layout (resharding is the checkpoint tool's)."""
        self.iteration, self.applied_steps = int(sd["iteration"]), int(sd["applied_steps"])
        self.scaler.load_state_dict({k[len("scaler."):]: v for k, v in sd.items()
                                     if k.startswith("scaler.")})
        for i, b in enumerate(self.buffers):
            with self.states.checkout(i) as st:
                for name, t in st.items():
                    t.copy_(sd[f"bucket{i}.{name}"])
            b.write_params(sd[f"bucket{i}.master"].to(b.params.device))
        for pending in [b.all_gather_params() for b in self.buffers]:
            pending.wait()
        if self.zero3 is not None:
            self.zero3.release_all()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy for a checkpoint; a `meta` tensor stays meta (the dry run sizes checkpoints
    without data: tools/dry_run.py)."""
    return t.detach().clone() if t.is_meta else t.detach().cpu().clone()


def _named(module: nn.Module, chunk: int, modules: list[nn.Module]):
    prefix = chunk_prefix(chunk, len(modules))
    return [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]


def build_optimizer(model_or_chunks, topo, cfg: OptimizerConfig,
                    dtype: torch.dtype = torch.float32) -> ZeroOptimizer:
    """Wrap a model (or a pipeline rank's list of model chunks) in the ZeRO optimizer, its
    weights in `dtype` (the model config's: `run.model.dtype`)."""
    modules = list(model_or_chunks) if isinstance(model_or_chunks, (list, tuple)) \
        else [model_or_chunks]
    return ZeroOptimizer(modules, topo, cfg, dtype)
