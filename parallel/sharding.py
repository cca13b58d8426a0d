"""Move between full (unsharded) tensors and this rank's tensor-parallel shards.

Works from the split each parallel layer records (`spec_of(param).tp_split`; expert weights,
`spec_of(param).expert`, are stacked [experts, ...] and split over expert parallelism along dim 0),
so it needs no knowledge of the model. Full tensors are unpadded: vocabulary padding is added on sharding and trimmed on
gathering.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .collectives import all_gather
from .expert_parallel import ep_rank
from .param_spec import spec_of
from .tensor_parallel import shard_of, unshard
from .topology import ParallelTopology


def local_shard(param: torch.Tensor, full: torch.Tensor, topo: ParallelTopology,
                expert_parallel: bool = True) -> torch.Tensor:
    """This rank's part of `full` for a parameter shaped like `param` (`expert_parallel` False:
    `full` holds this rank's experts only, and only the TP split is applied)."""
    spec = spec_of(param)
    if spec.expert and expert_parallel:
        full = full.narrow(0, ep_rank(topo) * param.shape[0], param.shape[0])
    split = spec.tp_split
    if split is None:
        return full
    return shard_of(full, split.dim, topo.tp_rank, topo.tp,
                    padded_size=param.shape[split.dim] * topo.tp, layout=split.layout)


def full_tensor(param: torch.Tensor, topo: ParallelTopology, tensor: torch.Tensor | None = None,
                expert_parallel: bool = True):
    """Gather a TP-sharded (or expert-parallel) tensor (the parameter, or e.g. its gradient)
    into its full shape (`expert_parallel` False: gather over TP only, keep this rank's experts)."""
    t = param.detach() if tensor is None else tensor
    spec = spec_of(param)
    if spec.expert and expert_parallel:
        t = all_gather(t, topo.ep_group, dim=0)
    split = spec.tp_split
    if split is None:
        return t
    dim = split.dim
    gathered = all_gather(t.movedim(dim, 0).contiguous(), topo.tp_group, dim=0).movedim(0, dim)
    return unshard(list(gathered.chunk(topo.tp, dim)), dim, split.full_size, split.layout)


def _name_of(model: nn.Module) -> Callable[[str], str]:
    return getattr(model, "canonical_name", lambda n: n)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], topo: ParallelTopology) -> None:
    """Copy full tensors into a (possibly sharded) model; every parameter must be present."""
    canonical = _name_of(model)
    missing = [canonical(n) for n, _ in model.named_parameters() if canonical(n) not in full]
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} parameters of this model, e.g. {missing[:3]}")
    for name, p in model.named_parameters():
        local = local_shard(p, full[canonical(name)], topo)
        if local.shape != p.shape:
            raise ValueError(f"{canonical(name)}: shape {tuple(local.shape)} does not fit the "
                             f"parameter's {tuple(p.shape)}; the checkpoint is for another model")
        p.copy_(local)


def gather_full_state_dict(model: nn.Module, topo: ParallelTopology, grads: bool = False) -> dict:
    """Full parameters (or their gradients) of this rank's model part, keyed by canonical name."""
    canonical = _name_of(model)
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        out[canonical(name) if not grads else name] = full_tensor(p, topo, t).cpu()
    return out
