"""The MoE experts' matmul: rows sorted by expert, each group times its own expert's weight,
the kernel picked by device and dtype (`choose_grouped_matmul`).

  CPU, fp32        `torch._grouped_mm` over the unpadded groups (MKL; ~2x faster than padding
                   every group to the largest when the load is uneven)
  CPU, bf16/fp16   `torch._grouped_mm` with each group's rows rounded up (`ONEDNN_ROW_MULTIPLE`,
                   `padded_group_sizes`: oneDNN compiles a kernel per shape)
  CUDA, bf16 sm90+ `torch._grouped_mm` over the unpadded groups (no padding to the largest
                   expert, so dropless routing costs the rows it routes, not experts x the
                   busiest expert's)
  meta             `torch._grouped_mm` over the unpadded groups: shapes only (the dry run,
                   training/run/dry_run.py), sized as the CUDA bf16 kernel runs (fp32/fp16,
                   which torch's meta kernel refuses: one expert's matmul of the same shapes)
  elsewhere        one matmul per expert (CUDA fp32/fp16 or before sm90, torch < 2.8), logged once

`torch._grouped_mm` needs every row of its operands to start on a 16-byte boundary (an fp32
expert width of 37, a bf16 width of 36 or a hidden size of 90 fail with "strides should be
multiple of 16 bytes"): `grouped_linear` zero-pads the feature dimensions to the next such
width for the call and slices the result (zero columns add nothing; autograd sees the pad).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .choice_log import log_choice_once

# On the CPU, bf16/fp16 matmuls run on oneDNN, which compiles a kernel for every new shape and
# caches 1024 of them. Routing changes each expert's row count every step, so every step compiled
# dozens of kernels and faulted in fresh pages for them (bench_moe, bf16: 486 ms per step, 23k
# page faults). Rounding each expert's rows up to a multiple of 32, or of 1/16 of the largest
# power of two below the count when that is larger (at most 6% more rows), makes the shapes
# repeat and their number small at any scale: 351 ms, no faults. fp32 (MKL, nothing compiled)
# needs no padding.
ONEDNN_ROW_MULTIPLE = 32
GROUPED_MM_CUDA_MIN_CAPABILITY = (9, 0)  # torch's CUDA grouped matmul: Hopper and later
ROW_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class GroupedMatmulChoice:
    kernel: str        # "grouped_mm" | "loop"
    row_multiple: int  # each group's rows rounded up to a multiple of this (1: unpadded)


def choose_grouped_matmul(device: torch.device, dtype: torch.dtype,
                          capability: tuple[int, int] | None = None) -> GroupedMatmulChoice:
    """The experts' kernel on `device` in `dtype` (`capability`: a CUDA device's (major,
    minor), read from the device when None)."""
    device = torch.device(device)
    if hasattr(torch, "_grouped_mm"):  # torch >= 2.8
        if device.type == "meta":
            return GroupedMatmulChoice("grouped_mm", 1)
        if device.type == "cpu":
            return GroupedMatmulChoice("grouped_mm", 1 if dtype == torch.float32
                                       else ONEDNN_ROW_MULTIPLE)
        if device.type == "cuda" and dtype == torch.bfloat16:
            if capability is None:
                capability = torch.cuda.get_device_capability(device)
            if tuple(capability) >= GROUPED_MM_CUDA_MIN_CAPABILITY:
                return GroupedMatmulChoice("grouped_mm", 1)
    return GroupedMatmulChoice("loop", 1)


class GroupedLinear(torch.autograd.Function):
    """y[rows of group e] = x[rows of group e] @ w[e].T for rows sorted by group (`offs`: the
    cumulative row counts, int32), as one `torch._grouped_mm` each way. torch 2.13 computes all
    three products on the CPU but its own backward of `_grouped_mm` fails there ("Invalid
    strides/sizes"), so the gradients are written out here."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        if x.shape[0] == 0:  # no rows (an expert-parallel rank sent every token away)
            return torch.zeros_like(x), torch.zeros_like(w), None
        g = g.contiguous()
        dx = torch._grouped_mm(g, w, offs=offs) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(g.t(), x, offs=offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _aligned_width(width: int, dtype: torch.dtype) -> int:
    per_row = max(ROW_ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size(), 1)
    return -(-width // per_row) * per_row


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`GroupedLinear` for x [rows, in], w [groups, out, in], with the feature widths
    zero-padded to 16-byte rows where they are not already."""
    out_f, in_f = w.shape[1], w.shape[2]
    out_p, in_p = _aligned_width(out_f, w.dtype), _aligned_width(in_f, w.dtype)
    if (out_p, in_p) == (out_f, in_f):
        return GroupedLinear.apply(x, w, offs)
    y = GroupedLinear.apply(F.pad(x, (0, in_p - in_f)), F.pad(w, (0, in_p - in_f, 0, out_p - out_f)),
                            offs)
    return y[:, :out_f]


def _eager_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` kept out of compiled graphs. Wrapped at the call, not at import: the
    wrapper imports torch's compiler (a second and a half), which eager runs never need."""
    return torch.compiler.disable(grouped_linear)(x, w, offs)


def padded_group_sizes(counts: torch.Tensor, multiple: int) -> torch.Tensor:
    """Each count rounded up to a multiple of max(`multiple`, 2^floor(log2 count) / 16)."""
    octave = torch.log2(counts.clamp(min=1).double()).floor()
    step = (2 ** (octave - 4)).clamp(min=multiple).long()
    return (counts + step - 1) // step * step


def pad_groups(x: torch.Tensor, counts: torch.Tensor, multiple: int):
    """Rows sorted by group -> (the rows with each group zero-padded by `padded_group_sizes`,
    the padded counts, where each original row now sits). Zero rows give zero outputs that
    nobody reads, so they add nothing to any gradient."""
    padded = padded_group_sizes(counts, multiple)
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    rows = torch.arange(x.shape[0], device=x.device) + shift[group]
    grid = x.new_zeros(int(padded.sum()), x.shape[1]).index_copy(0, rows, x)
    return grid, padded, rows


class ExpertMatmuls:
    """The grouped matmuls of one forward through the experts, for rows sorted by expert with
    `counts[e]` rows for expert e:

        mm = ExpertMatmuls(x, counts)
        x = mm.rows_in               # the rows as the kernel wants them (padded on CPU bf16)
        y = mm.linear(x, w1) + b1[mm.expert] ...
        out = mm.rows_out(y)         # back to the caller's rows
    """

    def __init__(self, x: torch.Tensor, counts: torch.Tensor,
                 choice: GroupedMatmulChoice | None = None):
        self.choice = choice or choose_grouped_matmul(x.device, x.dtype)
        self._unpad = None
        if self.choice.row_multiple > 1:
            x, counts, self._unpad = pad_groups(x, counts, self.choice.row_multiple)
        self.rows_in, self.counts = x, counts
        self.expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                              output_size=x.shape[0])  # known: no device sync
        if self.choice.kernel == "grouped_mm":
            self._offs = counts.cumsum(0).to(torch.int32)
        else:
            log_choice_once(__name__, f"MoE experts on {x.device.type} {x.dtype}: one matmul per "
                            f"expert (torch._grouped_mm runs on the CPU and on CUDA sm90+ in bf16)")
            self._sizes = counts.tolist()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each group's rows of x [rows, in] times its weight w [groups, out, in] transposed."""
        if self.choice.kernel == "grouped_mm" and torch.compiler.is_compiling() and \
                x.dtype != torch.bfloat16:
            # torch's compile-time (fake) `_grouped_mm` takes bf16 only: the experts run eager
            # inside a compiled layer (a graph break --compile reports)
            return _eager_grouped_linear(x, w, self._offs)
        if self.choice.kernel == "grouped_mm" and x.device.type == "meta" and \
                x.dtype != torch.bfloat16:
            # torch's meta `_grouped_mm` takes bf16 only: a dry run in fp32/fp16 sizes the
            # product by one expert's matmul (the same rows in and out, the same input saved)
            return x @ w[0].t()
        if self.choice.kernel == "grouped_mm":
            return grouped_linear(x, w, self._offs)
        pieces = x.split(self._sizes)
        return torch.cat([p @ w[e].t() for e, p in enumerate(pieces)]) if pieces else \
            x.new_zeros(0, w.shape[1])

    def rows_out(self, y: torch.Tensor) -> torch.Tensor:
        return y if self._unpad is None else y[self._unpad]
