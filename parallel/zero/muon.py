"""Muon on ZeRO buckets: momentum orthogonalised by Newton-Schulz, on whole matrices.

The arithmetic is torch.optim.Muon's (torch 2.13), operation by operation:

    buf <- lerp(buf, g, 1 - mu)                      momentum, elementwise: on this rank's shard
    u   <- lerp(g, buf, mu) if nesterov else buf     elementwise: on this rank's shard
    O   <- NewtonSchulz(u)                           needs the WHOLE matrix
    w   <- w * (1 - lr * wd) - lr * scale(shape) * O

Newton-Schulz needs whole matrices, while ZeRO splits a bucket into contiguous data-parallel
shards (a matrix may straddle two ranks) and tensor parallelism splits a matrix over TP ranks.
So, per Muon bucket:

1. each rank updates the momentum of its shard and forms u on it;
2. u is all-gathered over the bucket's data-parallel group (every rank sees every matrix);
3. the bucket's matrices are dealt to the data-parallel ranks, largest first onto the least
   loaded (`assign_matrices`); a rank orthogonalises only its own: a TP-sharded matrix is first
   gathered whole over its TP group (`parallel.sharding.full_tensor`, which undoes interleaved
   layouts, padding and replicated KV heads), orthogonalised, and this TP rank's slice kept; an
   expert weight [experts, out, in] is a batch of matrices, each expert orthogonalised alone, so
   expert parallelism needs no gather;
4. the scaled updates (zeros where another rank owns the matrix) are reduce-scattered: a sum with
   zeros is exact, so each rank receives exactly its shard of every orthogonalised update.

The TP ranks of one data-parallel rank hold buckets of the same shapes, so they deal the same
matrices to the same rank and meet in the same TP gathers in the same order. Pipeline stages
have their own buckets (each stage its own matrices). The state is one fp32 `momentum_buffer`
per bucket shard, stored, offloaded, checkpointed and resharded exactly like Adam's moments.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .. import collectives as C
from ..param_spec import spec_of
from ..sharding import full_tensor, local_shard
from .errors import ZeroConfigError

# Parameters matched by any of these (regular expressions searched in the parameter's name, as the
# model names it: `embedding.word_embeddings.weight`, `embedding.position_embeddings.weight`, the
# untied head `head_weight`) get AdamW even when they are matrices: Muon's authors and Moonlight
# keep the embeddings and the LM head on AdamW. Overridden by --muon-adamw-params.
DEFAULT_ADAMW_PATTERNS = ("embedding", "head_weight")

# --muon-scale-mode: the factor on the learning rate of an (out, in) matrix, times
# --muon-extra-scale-factor. Megatron-core's names; `spectral` with factor 0.2 is Moonlight's rule
# (torch.optim.Muon's adjust_lr_fn="match_rms_adamw"): the update's RMS then matches AdamW's, so
# one learning rate serves both. `shape_scaling` is Keller Jordan's (torch's "original").
SCALE_MODES = {
    "spectral": lambda out, inp: math.sqrt(max(out, inp)),
    "shape_scaling": lambda out, inp: math.sqrt(max(1.0, out / inp)),
    "unit_rms_norm": lambda out, inp: math.sqrt(out / inp),
}
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NS_EPS = 1e-7  # torch.optim.Muon's: the floor of the norm the input is divided by


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95  # --muon-momentum
    nesterov: bool = True  # --muon-use-nesterov / --no-muon-use-nesterov
    ns_steps: int = 5  # --muon-num-ns-steps
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)  # quintic
    scale_mode: str = "spectral"  # --muon-scale-mode
    extra_scale_factor: float = 0.2  # --muon-extra-scale-factor
    # --muon-ns-dtype: bf16 (torch.optim.Muon's) runs on GPU tensor cores, and on a CPU with
    # AVX512-BF16 measured 3-20x faster than fp32 (bench/bench_muon.py); fp32 for CPUs without.
    ns_dtype: str = "bf16"
    adamw_patterns: tuple[str, ...] = DEFAULT_ADAMW_PATTERNS  # --muon-adamw-params

    def validate(self) -> None:
        if self.scale_mode not in SCALE_MODES:
            raise ZeroConfigError(f"--muon-scale-mode must be one of {sorted(SCALE_MODES)}, "
                                  f"got {self.scale_mode!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ZeroConfigError(f"--muon-ns-dtype must be bf16 or fp32, got "
                                  f"{self.ns_dtype!r}")
        if not 0 <= self.momentum < 1:
            raise ZeroConfigError(f"--muon-momentum must be in [0, 1), got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ZeroConfigError(f"--muon-num-ns-steps must be in [1, 99], got {self.ns_steps}")
        for pattern in self.adamw_patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ZeroConfigError(f"--muon-adamw-params {pattern!r} is not a regular "
                                      f"expression ({e}); give e.g. 'embedding'") from None

    def lr_scale(self, shape) -> float:
        out, inp = shape[-2], shape[-1]
        return SCALE_MODES[self.scale_mode](out, inp) * self.extra_scale_factor


def uses_muon(name: str, param: torch.Tensor, settings: MuonSettings) -> bool:
    """The one rule: Muon for the hidden matrices (an expert's stacked [experts, out, in] weight
    counts as one matrix per expert), AdamW for everything else: 1-D parameters (biases, norms),
    the tied embedding, and names matching the AdamW patterns (embeddings, LM head)."""
    spec = spec_of(param)
    if param.dim() != (3 if spec.expert else 2) or spec.tied_embedding:
        return False
    return not any(re.search(p, name) for p in settings.adamw_patterns)


def newton_schulz(x: torch.Tensor, coefficients, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Approximately orthogonalise the last two dims of `x` (torch.optim.Muon's quintic iteration;
    a leading dim is a batch of matrices, e.g. experts)."""
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True) if y.dim() == 3 else y.norm()
    y = y / norm.clamp(min=NS_EPS)
    for _ in range(steps):
        if y.dim() == 2:
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
        else:
            gram = y @ y.mT
            y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.mT if tall else y


def assign_matrices(numels: list[int], ranks: int) -> list[int]:
    """Deal matrices to ranks, largest first onto the least loaded (ties: the lower index), so
    every rank computes the same assignment."""
    load, owner = [0] * ranks, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + numels[i]
    return owner


class Muon:
    """The inner optimizer of Muon buckets; `update_bucket` replaces the elementwise `update`."""
    state_names = ("momentum_buffer",)

    def __init__(self, settings: MuonSettings, topo):
        self.s, self.topo = settings, topo
        self.ns_dtype = NS_DTYPES[settings.ns_dtype]

    def update_bucket(self, bucket, master: torch.Tensor, grad: torch.Tensor,
                      state: dict[str, torch.Tensor], h, grad_mult: float = 1.0) -> None:
        """One step of the bucket's shard `master` (fp32) given its gradient shard."""
        if grad_mult != 1.0:
            grad = grad * grad_mult
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - self.s.momentum)
        u = grad.lerp(buf, self.s.momentum) if self.s.nesterov else buf
        device = self.topo.device
        full = torch.empty(bucket.padded, dtype=torch.float32, device=device)
        C.all_gather_into(full, u.to(device).contiguous(),
                          bucket.dp_group if bucket.dp > 1 else C.SINGLE).wait()
        updates = torch.zeros_like(full)
        owner = assign_matrices([s.numel for s in bucket.slots], bucket.dp)
        for s, rank in zip(bucket.slots, owner):
            if rank != bucket.dp_rank:
                continue
            local = full[s.offset:s.offset + s.numel].view(s.param.shape)
            # Experts are independent matrices: gather over TP only, never over EP.
            whole = full_tensor(s.param, self.topo, local, expert_parallel=False)
            ortho = newton_schulz(whole, self.s.ns_coefficients, self.s.ns_steps, self.ns_dtype)
            mine = local_shard(s.param, ortho.float(), self.topo, expert_parallel=False)
            updates[s.offset:s.offset + s.numel].copy_(
                mine.reshape(-1)).mul_(h.lr * self.s.lr_scale(whole.shape))
        shard = torch.empty(bucket.shard_numel, dtype=torch.float32, device=device)
        if bucket.dp > 1:
            C.reduce_scatter_into(shard, updates, bucket.dp_group).wait()
        else:
            shard = updates
        master.mul_(1 - h.lr * h.weight_decay)
        master.sub_(shard.to(master.device))
