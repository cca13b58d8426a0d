"""FP8 releases (DeepSeek-V3, Kimi K2, the Qwen3 "-FP8" folders, ...) dequantized at import.

Such a folder's config.json carries `quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`, and its weight files hold,
beside each quantized tensor `<name>` (float8 e4m3), a tensor `<name>_scale_inv` (float32): one
factor per block of `weight_block_size` (rows, columns) of the tensor's last two dimensions, the
grid rounded up, so an edge block is partial when a size is not a multiple of the block (DeepSeek-V3's
kv_a_proj_with_mqa: 576 rows, 5 row blocks). The rule, as DeepSeek's `fp8_cast_bf16.py`
(`weight_dequant`) and transformers' `_dequantize_fp8_weight` compute it:

    weight[..., i, j] = float32(fp8[..., i, j]) * scale_inv[..., i // block_rows, j // block_cols]

in float32 (one rounding), for exactly the tensors that have a `_scale_inv` sibling (the
embedding, the head, the norms and DeepSeek's router are stored unquantized). Without
`weight_block_size` the scale is one number per tensor. `scale_fmt: "ue8m0"` scales are powers of
two: float ones are used as they are, bytes as 2**(byte - 127). The model is then an ordinary one:
it trains, and export writes plain weights (in config.json's dtype, the release's bfloat16, or
--dtype), never FP8. Refused, one line each: another quant_method or format, static activation
scales (the released model quantizes its activations with fixed scales: another function), a
scale grid that does not fit its tensor, an FP8 tensor without its scale.
"""
from __future__ import annotations

import json
import logging
import os

import torch

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                           "float8_e5m2fnuz") if hasattr(torch, n))
# quantization_config keys that change nothing once the weights are dequantized (which modules
# are quantized is read from the files: a tensor with a scale is)
_BOOKKEEPING = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt",
                "modules_to_not_convert", "modules_to_convert", "dequantize"}
_MXFP4_BOOKKEEPING = {"quant_method", "modules_to_not_convert", "dequantize"}


def read_quantization(folder: str) -> dict | None:
    """config.json's quantization_config, checked (None when the folder is not quantized)."""
    path = os.path.join(folder, "config.json")
    try:
        quant = json.load(open(path)).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # read_hf_config names an unreadable config.json
    if quant is None:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(quant, dict) or quant.get("quant_method") not in ("fp8", "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"{where} quant_method {method!r} is not supported (megazoo imports FP8 "
                         f"block-scaled releases, quant_method 'fp8', and MXFP4 ones, 'mxfp4'); "
                         f"import an unquantized folder")
    if quant["quant_method"] == "mxfp4":  # hf_mxfp4.py: the files say which tensors are packed
        unknown = sorted(set(quant) - _MXFP4_BOOKKEEPING)
        if unknown:
            raise ValueError(f"{where} has fields megazoo does not model ({', '.join(unknown)}); "
                             f"supported: {sorted(_MXFP4_BOOKKEEPING)}")
        return quant
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where} fmt {quant['fmt']!r} is not supported (e4m3 only)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where} activation_scheme {quant['activation_scheme']!r} is not "
                         f"supported (the model would quantize its activations with fixed "
                         f"scales: 'dynamic' only)")
    block = quant.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where} weight_block_size {block!r} is not two positive integers")
    unknown = sorted(set(quant) - _BOOKKEEPING)
    if unknown:
        raise ValueError(f"{where} has fields megazoo does not model ({', '.join(unknown)}); "
                         f"supported: {sorted(_BOOKKEEPING)}")
    return quant


def _scales(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # ue8m0 exponents stored as bytes
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_tensor(fp8: torch.Tensor, scale_inv: torch.Tensor, block: list | None,
                      name: str = "tensor") -> torch.Tensor:
    """One quantized tensor in float32: each element times its block's scale_inv."""
    scale = _scales(scale_inv)
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"{name}{SCALE_SUFFIX} holds {scale.numel()} scales; without "
                             f"weight_block_size there is one per tensor")
        return fp8.float() * scale.reshape(())
    if fp8.dim() < 2:
        raise ValueError(f"{name} is {fp8.dim()}-dimensional; block scales need a matrix")
    (rows, cols), (bm, bn) = fp8.shape[-2:], block
    grid = (*fp8.shape[:-2], -(-rows // bm), -(-cols // bn))
    if tuple(scale.shape) != grid:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}; {name} "
                         f"{tuple(fp8.shape)} in blocks of {bm}x{bn} needs {grid}")
    full = scale.repeat_interleave(bm, -2)[..., :rows, :].repeat_interleave(bn, -1)[..., :cols]
    return fp8.float() * full


def dequantize(sd: dict[str, torch.Tensor], quant: dict, where: str) -> dict[str, torch.Tensor]:
    """The weights with every FP8 tensor dequantized and the scales dropped (logged once)."""
    static = sorted(k for k in sd if k.endswith(("activation_scale", "input_scale")))
    if static:
        raise ValueError(f"{where}: {static[0]} is a static activation scale (the model quantizes "
                         f"its activations); megazoo imports weight-only FP8 releases")
    block = quant.get("weight_block_size")
    out = {k: v for k, v in sd.items() if not k.endswith(SCALE_SUFFIX)}
    done = 0
    for key in sorted(k for k in sd if k.endswith(SCALE_SUFFIX)):
        name = key[:-len(SCALE_SUFFIX)]
        if name not in sd or sd[name].dtype not in _FP8:
            raise ValueError(f"{where}: {key} scales "
                             + (f"{name}, which is {sd[name].dtype}, not FP8" if name in sd else
                                f"no tensor {name}") + "; the folder is not an FP8 release")
        out[name] = dequantize_tensor(sd[name], sd[key], block, name)
        done += 1
    left = sorted(k for k, v in out.items() if v.dtype in _FP8)
    if left:
        raise ValueError(f"{where}: {left[0]} is FP8 without {left[0]}{SCALE_SUFFIX} "
                         f"({len(left)} such tensors); copy every weight file of the release")
    logger.info("%s: dequantized %d FP8 %s tensor(s) to float32 (each element times its "
                "%s's scale_inv); export writes plain weights", where, done,
                quant.get("fmt", "e4m3"),
                f"{block[0]}x{block[1]} block" if block else "tensor")
    return out
