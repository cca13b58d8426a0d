"""Large short-lived CPU tensors on transparent huge pages.

A tensor of tens of megabytes is a fresh anonymous mapping each time it is allocated (glibc maps
anything above 32 MiB on its own and unmaps it on free), so every step pays one page fault per
4 KiB of it on first touch, and the kernel zeroes each page. For the fused LM-head loss at a
GPT-2 vocabulary (2048 tokens x 50k logits, 206 MB in bf16, 412 MB in fp32) that is 70-145 ms
per step on one AMD EPYC core, more than the softmax itself. Asking for huge pages on the
mapping (`madvise(MADV_HUGEPAGE)`, what PyTorch's own `THP_MEM_ALLOC_ENABLE=1` does for every
allocation) takes one fault per 2 MiB: 412 MB then cost 25 ms instead of 157 ms.

Only the buffers that ask for it get the hint (the process's allocator is left alone), only on
Linux CPUs, and only whole 2 MiB pages inside the tensor; elsewhere (CUDA, other systems, a
kernel that refuses the hint) this is `torch.empty`. The hint changes no value.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux, every architecture
MIN_BYTES = 8 << 20  # below this glibc reuses its heap and faults are few


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_large(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(shape)`; on a Linux CPU, a tensor of MIN_BYTES or more asks for huge pages
    before anything touches it."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if out.device.type != "cpu" or nbytes < MIN_BYTES or (madvise := _madvise()) is None:
        return out
    start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start and madvise(start, end - start, MADV_HUGEPAGE) != 0:
        logging.getLogger(__name__).debug("madvise(MADV_HUGEPAGE) refused (errno %d): small pages",
                                          ctypes.get_errno())
    return out
