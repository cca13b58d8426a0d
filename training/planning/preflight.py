"""The numerics preflight: before a layout gets a cluster, its CPU twin (twin.py) trains a few
steps under the same composition of parallelisms in a spawned gloo world, and again unsharded in
one process, from the same weights and data; the largest divergence of the loss, the gradient
norm and the parameters after the steps is compared with the tolerances the project's own parity
tests hold (by precision). When the composition diverges, each dimension is run alone to name
the one that brings the divergence.

Parameters are judged by how far they moved from the reference relative to how far training
moved them (the rule of tests/tolerances.py): ||got - want|| / max(||want - init||,
lr sqrt(numel)), per tensor.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import tempfile
from dataclasses import dataclass

import torch

from megazoo.parallel.layout import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    loss: float  # relative, per step
    grad_norm: float  # relative, per step
    params: float  # the trained-deviation rule above


TOLERANCES = {"float32": Tolerance(1e-5, 1e-5, 1e-3), "bfloat16": Tolerance(2e-2, 5e-2, 0.2),
              "float16": Tolerance(1e-2, 3e-2, 0.1)}


@dataclass
class Divergence:
    loss: float
    grad_norm: float
    params: float
    worst_param: str

    def within(self, tol: Tolerance) -> bool:
        return self.loss <= tol.loss and self.grad_norm <= tol.grad_norm and \
            self.params <= tol.params

    def describe(self, tol: Tolerance) -> str:
        return (f"loss {self.loss:.1e} (tolerance {tol.loss:.0e}), gradient norm "
                f"{self.grad_norm:.1e} ({tol.grad_norm:.0e}), parameters {self.params:.1e} of "
                f"their update ({tol.params:.0e}; worst {self.worst_param})")


def dimensions(parallel: ParallelConfig, dp: int, zero_stage: int) -> dict[str, tuple]:
    """Each dimension of the twin layout above 1, alone: name -> (ParallelConfig, dp)."""
    out = {}
    if parallel.tp > 1:
        out["tp"] = (ParallelConfig(tp=parallel.tp, sequence_parallel=parallel.sequence_parallel), 1)
    if parallel.pp > 1:
        out["pp"] = (ParallelConfig(pp=parallel.pp, vpp=parallel.vpp,
                                    first_stage_layers=parallel.first_stage_layers,
                                    last_stage_layers=parallel.last_stage_layers), 1)
    if parallel.cp > 1:
        out["cp"] = (ParallelConfig(cp=parallel.cp, cp_comm_type=parallel.cp_comm_type), 1)
    if parallel.ep > 1:
        out["ep"] = (ParallelConfig(ep=parallel.ep), max(dp, parallel.ep))
    if dp > 1:
        out["dp" if zero_stage == 0 else f"dp (ZeRO-{zero_stage})"] = (ParallelConfig(), dp)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, run, setup: str | None) -> None:
    """One rank of a twin run (spawned): the trainer itself, on the gloo backend."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      CUDA_VISIBLE_DEVICES="")  # the twin runs on the CPU, gloo, anywhere
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # the twin is tiny; its ranks share the machine
    if setup:  # a fault drill: module:function run in every rank before training
        import importlib
        module, name = setup.split(":")
        getattr(importlib.import_module(module), name)()
    import torch.distributed as dist

    from megazoo.models.registry import build_model
    from megazoo.parallel import collectives as C
    from megazoo.training.run.loop import pretrain
    try:
        pretrain(build_model, run)
        C.barrier(C.world())  # leave together: a gloo rank torn down under a peer aborts it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(run, parallel: ParallelConfig, dp: int, folder: str, setup: str | None = None,
          start_method: str = "spawn") -> dict:
    """Train `run` at `parallel` x `dp` (processes started by `start_method`), saving into
    `folder`: returns the per-step losses and gradient norms and the final weights (full
    tensors)."""
    from megazoo.training.checkpoint.reshard import read_full_state
    from megazoo.training.checkpoint.format import latest_checkpoint
    run = dataclasses.replace(run, parallel=parallel, checkpoint=dataclasses.replace(
        run.checkpoint, save=folder, load=None, save_interval=run.schedule.train_iters,
        async_save=False, keep_last=None, keep_every=None),
        logging=dataclasses.replace(run.logging, log_interval=1, eval_interval=0,
                                    wandb_project=None, tensorboard_dir=None))
    world = parallel.tp * parallel.pp * parallel.cp * dp
    torch.multiprocessing.start_processes(_worker, args=(world, _free_port(), run, setup),
                                          nprocs=world, start_method=start_method, join=True)
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    train_rows = [r for r in rows if r.get("split") == "train"]
    # the fp32 masters where the optimizer keeps them (bf16/fp16 weights round away small updates)
    full = read_full_state(latest_checkpoint(folder))
    return dict(loss=[r["loss"] for r in train_rows], grad_norm=[r["grad_norm"] for r in train_rows],
                weights={**full.weights, **full.master})


def _relative(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or not want:
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def divergence(got: dict, want: dict, init: dict[str, torch.Tensor], lr: float) -> Divergence:
    worst, name = 0.0, "-"
    for n, w in want["weights"].items():
        g = got["weights"].get(n)
        if g is None or g.shape != w.shape:
            return Divergence(math.inf, math.inf, math.inf, n)
        moved = (w.double() - init[n].double()).norm().item()
        dev = (g.double() - w.double()).norm().item() / max(moved, lr * math.sqrt(w.numel()))
        if dev > worst:
            worst, name = dev, n
    return Divergence(_relative(got["loss"], want["loss"]),
                      _relative(got["grad_norm"], want["grad_norm"]), worst, name)


def initial_weights(model) -> dict[str, torch.Tensor]:
    """The twin's weights before training (the same in every layout: TransformerConfig.seed)."""
    from megazoo.training.checkpoint.layout_writer import build_rank_chunks
    from megazoo.training.checkpoint.param_table import param_table, table_order
    _, chunks = build_rank_chunks(model)
    out = {}
    for row, (*_, p) in zip(param_table(chunks, frozen=True), table_order(chunks)):
        full = p.narrow(row.tp_dim, 0, row.full_size) if row.tp_dim >= 0 else p
        out[row.canonical] = full.detach().clone()
    return out


@dataclass
class Report:
    layout: str
    divergence: Divergence
    tolerance: Tolerance
    by_dimension: dict[str, Divergence]

    @property
    def passed(self) -> bool:
        return self.divergence.within(self.tolerance)

    def lines(self) -> list[str]:
        out = [f"{self.layout} vs unsharded: {self.divergence.describe(self.tolerance)}: "
               + ("PASS" if self.passed else "FAIL")]
        for dim, d in self.by_dimension.items():
            out.append(f"  {dim} alone: {d.describe(self.tolerance)}: "
                       + ("pass" if d.within(self.tolerance) else "FAIL"))
        failing = [d for d, v in self.by_dimension.items() if not v.within(self.tolerance)]
        if not self.passed:
            out.append("the divergence comes with " + (", ".join(failing) if failing else
                       "the combination (no dimension diverges alone)"))
        return out


def preflight(twin, dp: int, *, setup: str | None = None, workdir: str | None = None,
              start_method: str = "spawn") -> Report:
    """Run the twin (twin.twin_run's RunConfig at its layout x `dp`) against the unsharded twin;
    on a divergence, each dimension alone. `start_method`: how the ranks start ("fork" saves
    each its torch import where the platform forks safely)."""
    tol = TOLERANCES[twin.model.params_dtype]
    init = initial_weights(twin.model)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        ref = train(twin, ParallelConfig(), 1, os.path.join(tmp, "unsharded"), setup, start_method)
        got = train(twin, twin.parallel, dp, os.path.join(tmp, "twin"), setup, start_method)
        div = divergence(got, ref, init, twin.schedule.lr)
        by_dim = {}
        if not div.within(tol):
            for name, (parallel, d) in dimensions(twin.parallel, dp,
                                                 twin.optimizer.zero_stage).items():
                alone = train(twin, parallel, d, os.path.join(tmp, name.split()[0]), setup,
                              start_method)
                by_dim[name] = divergence(alone, ref, init, twin.schedule.lr)
    p = twin.parallel
    layout = " ".join(f"{k}{v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("vpp", p.vpp),
                                            ("cp", p.cp), ("ep", p.ep), ("dp", dp)) if v > 1)
    layout = (layout or "one rank") + (" sp" if p.sequence_parallel else "") + \
        f" zero{twin.optimizer.zero_stage} {twin.model.params_dtype}"
    return Report(layout, div, tol, by_dim)
