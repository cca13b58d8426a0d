"""LoRA on model chunks (a run's --lora-rank, or a LoRA checkpoint's record): adapters on the targeted linears of every layer
the chunk holds, started from `--lora-init`'s PEFT adapter or freshly (A kaiming-uniform seeded by
name, B zero: the model starts as its base), and everything else frozen, so the optimizer (and
ZeRO) hold the adapters only."""
from __future__ import annotations

import logging

import torch

from megazoo.parallel.lora import LoRAAdapter, attach, freeze_all_but_adapters, kaiming_uniform

from . import lora_targets as lt
from .lora_targets import LoRASettings
from .peft_format import read_adapter

logger = logging.getLogger(__name__)


def starting_tensors(lora: LoRASettings, config, seed: int, layers) -> dict[str, torch.Tensor]:
    """Full starting A and B of the adapters of global `layers`, by megazoo name (a fresh B is
    a broadcast zero: no memory)."""
    if lora.init_dir:
        return read_adapter(lora.init_dir, lora.targets, config)
    out = {}
    for i in layers:
        for target, module, _ in lt.sites(config.family, lora.targets):
            parts, _, fan_in = lt.module_parts(config, module)
            rows = dict(parts)[target]
            a_name, b_name = (lt.megazoo_name(i, module, target, w) for w in "AB")
            a = torch.empty(lora.rank, fan_in)
            kaiming_uniform(a_name, seed)(a)
            out[a_name], out[b_name] = a, torch.zeros(()).expand(rows, lora.rank)
    return out


def apply_lora(chunks, lora: LoRASettings, config, topo, rng, seed: int) -> None:
    """Attach the adapters to every chunk's targeted linears and freeze the rest."""
    start = starting_tensors(lora, config, seed, [int(i) for c in chunks for i in c.layers])
    modules = sorted({module for _, module, _ in lt.sites(config.family, lora.targets)})
    for chunk in chunks:
        for index, layer in chunk.layers.items():
            for module in modules:
                parts, groups, fan_in = lt.module_parts(config, module)
                base = layer.get_submodule(module)
                chosen = {n for n, _ in parts if n in lora.targets}
                part_start = {n: (start[lt.megazoo_name(int(index), module, n, "A")],
                                  start[lt.megazoo_name(int(index), module, n, "B")]) for n in chosen}
                attach(base, LoRAAdapter(
                    row_parallel=module in lt.ROW_PARALLEL, in_features=fan_in, parts=parts,
                    groups=groups, targeted=chosen, rank=lora.rank, alpha=lora.alpha,
                    dropout=lora.dropout, topo=topo, rng=rng, start=part_start,
                    rslora=lora.rslora, dtype=base.weight.dtype))
        freeze_all_but_adapters(chunk)
    if topo.rank == 0:
        trained = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        logger.info("LoRA rank %d alpha %g on %s%s: %d trainable parameters on this rank, the "
                    "base frozen", lora.rank, lora.alpha, ",".join(lora.targets),
                    f" from {lora.init_dir}" if lora.init_dir else "", trained)
