"""Which optimizer state a checkpoint holds, recorded in meta.json and checked before loading.

The optimizer states are per parameter: Adam's `exp_avg` / `exp_avg_sq` for the tensors AdamW
steps, Muon's `momentum_buffer` for the matrices Muon steps (`parallel/zero/muon.py`
`uses_muon`). Which tensors those are follows from --optimizer and, under Muon, from
--muon-adamw-params; a run that loads the states with either changed would look for states the
checkpoint never held. So the checkpoint records both, and a resume that loads the optimizer
state refuses a difference in one line naming the flag, before any tensor is read. Checkpoints
written before the record existed are not checked.
"""
from __future__ import annotations

from megazoo.parallel.zero.config import OptimizerConfig

from .format import CheckpointError


def optimizer_record(cfg: OptimizerConfig) -> dict:
    """meta.json's `optimizer`: what decides which state each parameter has."""
    record = {"name": cfg.optimizer}
    if cfg.optimizer == "muon":
        record["muon_adamw_params"] = list(cfg.muon.adamw_patterns)
    return record


def check_optimizer_record(meta: dict, cfg: OptimizerConfig, folder: str) -> None:
    """Refuse loading the optimizer state of `folder` into an optimizer that keeps other states."""
    saved = meta.get("optimizer")
    if saved is None:
        return
    here = optimizer_record(cfg)
    fresh = "or --finetune / --no-load-optim to start the optimizer afresh from these weights"
    if saved.get("name") != here["name"]:
        raise CheckpointError(f"{folder} holds {saved.get('name')} optimizer state, this run uses "
                              f"--optimizer {here['name']}; pass --optimizer {saved.get('name')}, "
                              f"{fresh}")
    if saved.get("muon_adamw_params") != here.get("muon_adamw_params"):
        there = " ".join(saved.get("muon_adamw_params") or [])
        raise CheckpointError(f"--muon-adamw-params {' '.join(here['muon_adamw_params'])} differs "
                              f"from {there} in {folder}: its Muon and AdamW states belong to "
                              f"other parameters; pass --muon-adamw-params {there}, {fresh}")
