"""Tokens per chunk of the fused LM head + cross-entropy (`parallel/fused_cross_entropy.py`
keeps the vocabulary-parallel math; only this device/dtype decision lives here).

Smaller chunks keep the fp32 scratch (4 bytes x chunk x vocab/tp) in cache but starve the matmul.
"""
from __future__ import annotations

import torch

# Measured on one CPU core (vocab 16k and 50k, hidden 512): fp32 wants >= 256 rows, bf16 (AMX)
# >= 64, and 1024 costs at most 10% against the best of either. GPUs take this too.
CHUNK_TOKENS = 1024
# bf16/fp16 on the CPU: on an AMD EPYC core (AVX512-BF16, hidden 256) forward + backward of 1024
# tokens took 54 / 41 / 46 ms at 1024 / 256 / 128 rows per chunk with vocab 4k, 462 / 403 / 377
# ms with vocab 32k; fp32 was level from 256 to 1024 rows. On a Xeon core with AMX: 36 / 36 / 34
# ms (vocab 4k), 330 / 270 / 205 (32k), hidden 1024 vocab 32k 520 / 501 / 574, hidden 2048
# vocab 50k 1427 / 1366 / 1432.
CPU_LOW_PRECISION_CHUNK_TOKENS = 256


def chunk_tokens(device: torch.device, dtype: torch.dtype) -> int:
    """Tokens the fused LM-head loss puts through the head at a time on `device` in `dtype`."""
    if torch.device(device).type == "cpu" and dtype != torch.float32:
        return min(CHUNK_TOKENS, CPU_LOW_PRECISION_CHUNK_TOKENS)
    return CHUNK_TOKENS


def row_softmax(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the chunk's softmax runs as ATen's row-wise softmax, in place on the fp32 scratch,
    instead of max, subtract, exp, sum and divide as separate passes over the whole chunk.

    Taken on the CPU when the stored gradient is bf16. Row by row, a 50k-entry row stays in cache
    for all of its passes, and ATen's vectorised exp is cheaper. On one AMD EPYC core, 256 x
    50,304 fp32 took 5.5 ms against 8.7 ms for the exp pass alone and about 17 ms for the five
    passes. That exp is accurate to about 4e-6 relative (a few fp32 ulps, against 1 ulp for
    `exp_`), which is far below the bf16 rounding of the stored gradient (4e-3). The loss keeps
    fp32 precision to the same 4e-6. fp32 keeps the separate passes and their 1-ulp exp. So does
    the GPU: the in-place use of the softmax kernel is checked on the CPU kernel only.
    """
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16
