"""The planner's layout: a run as the memory and step-time models see it.

It holds the trainer's own objects, spelled as the run configuration spells them: the
`ParallelConfig` (tp, pp, vpp, cp, ep, sequence parallelism, an uneven pipeline split), the
`OptimizerConfig` (ZeRO stage, optimizer, gradient dtype, Muon settings), the batch sizes and
sequence length of `ScheduleConfig` / `DataConfig`, and the weights' dtype and recompute
granularity of `TransformerConfig`. Only dp (the world size is not part of the run config) and
what the planner assumes about kernels (flash attention, overlapped gradient reduction) are its
own. `Layout.of_run` is the one place a `RunConfig` becomes a layout; `Layout.of` / `replace`
set fields by name, each where it lives, so no field list is written out twice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megazoo.models.config import PARAMS_DTYPES
from megazoo.parallel.layout import ParallelConfig
from megazoo.parallel.zero.config import OptimizerConfig

_PARALLEL = {f.name for f in dataclasses.fields(ParallelConfig)}
_OPTIMIZER = {f.name for f in dataclasses.fields(OptimizerConfig)}


@dataclass(frozen=True)
class Layout:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dp: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int = 1  # ScheduleConfig's
    global_batch_size: int = 1
    seq_length: int = 2048  # DataConfig's
    params_dtype: str = "bfloat16"  # TransformerConfig's: float32 | bfloat16 | float16
    recompute_granularity: str | None = None  # TransformerConfig's: None | selective | full
    flash_attention: bool = False  # attention scores never stored (SDPA / FlashAttention)
    overlap_dp: bool = False  # the data-parallel reduction hidden behind backward
    lora: object | None = None  # RunConfig's LoRASettings: the base frozen, adapters trained
    # DPO / GRPO's KL reference loaded beside the policy (no LoRA: its weights are a second,
    # frozen copy, sharded like the policy's by TP and PP, whole over DP)
    reference: bool = False

    @classmethod
    def of(cls, **fields) -> "Layout":
        """A layout from field names of the layout, `ParallelConfig` or `OptimizerConfig`."""
        return cls().replace(**fields)

    @classmethod
    def of_run(cls, run, dp: int) -> "Layout":
        """The planner's view of a `RunConfig` on `dp` data-parallel ranks (SDPA: flash)."""
        return cls(parallel=run.parallel, dp=dp, optimizer=run.optimizer,
                   micro_batch_size=run.schedule.micro_batch_size,
                   global_batch_size=run.schedule.global_batch_size,
                   seq_length=run.data.seq_length, params_dtype=run.model.params_dtype,
                   recompute_granularity=run.model.recompute_granularity, flash_attention=True,
                   lora=getattr(run, "lora", None),
                   reference=any(getattr(getattr(run, kind, None), "reference", None) is not None
                                 for kind in ("dpo", "grpo")))

    def replace(self, **changes) -> "Layout":
        """This layout with fields changed by name, each where it lives: the layout's own
        (`optimizer` and `parallel` replace the whole object), else ParallelConfig's, else
        OptimizerConfig's."""
        own = {k: changes.pop(k) for k in list(changes) if k in self.__dataclass_fields__}
        parallel = {k: changes.pop(k) for k in list(changes) if k in _PARALLEL}
        optimizer = {k: changes.pop(k) for k in list(changes) if k in _OPTIMIZER}
        if changes:
            raise TypeError(f"Layout has no field {sorted(changes)[0]!r} (nor ParallelConfig or "
                            f"OptimizerConfig)")
        for name, kind in (("parallel", ParallelConfig), ("optimizer", OptimizerConfig)):
            if name in own and not isinstance(own[name], kind):
                raise TypeError(f"Layout.{name} is a {kind.__name__}, got {own[name]!r}")
        new = dataclasses.replace(self, **own)
        return dataclasses.replace(new, parallel=dataclasses.replace(new.parallel, **parallel),
                                   optimizer=dataclasses.replace(new.optimizer, **optimizer))

    # The parallel sizes are the formulas' symbols (t, p, v, c, e): read through `parallel`.
    tp = property(lambda self: self.parallel.tp)
    pp = property(lambda self: self.parallel.pp)
    vpp = property(lambda self: self.parallel.vpp)
    cp = property(lambda self: self.parallel.cp)
    ep = property(lambda self: self.parallel.ep)

    @property
    def dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient: fp32 accumulation, or the weights' dtype (OptimizerConfig's
        grad_dtype "model", the ZeRO paper's accounting)."""
        return self.optimizer.grad_torch_dtype(self.dtype).itemsize

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect (the trainer ignores the flag at tp 1)."""
        return self.parallel.sequence_parallel and self.tp > 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same experts."""
        return self.dp * self.cp // self.ep

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def describe(self) -> str:
        extra = (f" vpp{self.vpp}" if self.vpp > 1 else "") + (" sp" if self.sequence_parallel else "") \
            + (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        opt = self.optimizer
        kind = f" {opt.optimizer}" if opt.optimizer != OptimizerConfig.optimizer else ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}{extra} zero{opt.zero_stage}{kind} "
                f"rc={self.recompute_granularity or 'none'} mbs{self.micro_batch_size} "
                f"gbs{self.global_batch_size}")
