"""MXFP4 releases (gpt-oss) dequantized at import.

Such a folder's config.json carries `quantization_config: {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}` and its weight files hold each quantized expert matrix
`<name>` [experts, rows, columns] (transformers' in-memory `gate_up_proj` / `down_proj` are
[experts, columns, rows], the transpose) as two tensors:

* `<name>_blocks`, uint8 [experts, rows, columns / 32, 16]: 32 FP4 (e2m1) codes per block, two
  per byte, the low nibble the even element, the high nibble the odd one; a code is the value
  (+-) 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bit 3 the sign);
* `<name>_scales`, uint8 [experts, rows, columns / 32]: one power of two per block, 2**(byte - 127).

    weight[e, c, r] = fp4(code of element c in row r) * 2**(scale[e, r, c // 32] - 127)

as transformers' `convert_moe_packed_tensors` computes it. Every such product is exact in
float32 (a two-bit significand times a power of two), so the import is the released model
exactly. The biases, the attention, the router, the embedding and the head are stored
unquantized. The model is then an ordinary one: it trains, and export writes plain weights.
Refused, one line each: blocks and scales that do not pair up (shape, dtype, a missing half).
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

BLOCKS, SCALES = "_blocks", "_scales"
# the e2m1 values of the 16 codes (bit 3 the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_tensor(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """One MXFP4 matrix in float32, transposed to transformers' in-memory layout."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}{BLOCKS} / {name}{SCALES} are {blocks.dtype} / {scales.dtype}; "
                         f"MXFP4 stores both as uint8")
    if blocks.dim() < 3 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}{BLOCKS} has shape {tuple(blocks.shape)} and {name}{SCALES} "
                         f"{tuple(scales.shape)}; the blocks need the scales' shape plus one "
                         f"dimension of packed bytes")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = codes.flatten(-2) * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2).contiguous()


def dequantize(sd: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The weights with every MXFP4 pair dequantized under its plain name (logged once)."""
    out = {k: v for k, v in sd.items() if not k.endswith((BLOCKS, SCALES))}
    names = sorted({k[:-len(BLOCKS)] for k in sd if k.endswith(BLOCKS)}
                   | {k[:-len(SCALES)] for k in sd if k.endswith(SCALES)})
    for name in names:
        if name + BLOCKS not in sd or name + SCALES not in sd:
            half = BLOCKS if name + BLOCKS not in sd else SCALES
            raise ValueError(f"{where}: {name}{half} is missing beside its other half; copy every "
                             f"weight file of the release")
        out[name] = dequantize_tensor(sd[name + BLOCKS], sd[name + SCALES], name)
    logger.info("%s: dequantized %d MXFP4 tensor(s) to float32 (each FP4 value times its "
                "32-element block's power of two); export writes plain weights", where, len(names))
    return out
