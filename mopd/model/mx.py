"""OCP microscaling (MX) formats for the routed experts, from torchao: fake quantization for QAT and
the packed MXFP4 layout a quantized checkpoint stores.

An MX tensor splits its last dimension into blocks of 32 values that share one power-of-two scale
(E8M0); each value is an FP4 E2M1 (MXFP4) or an FP8 E4M3 (MXFP8) element. torchao's `to_mx` and
`to_dtype` do the rounding. They need the last dimension to be a multiple of 32; a tensor whose last
dimension is not (the tiny preset's latent width is 48) gets a final partial block: it is padded
with zeros, which cannot raise a block's maximum, so the real values quantize exactly as in a full
block, and the padding is dropped again.

The packed layout is compressed-tensors' `mxfp4-pack-quantized` (what vLLM reads for Kimi K3's
experts): `weight_packed` uint8 [out, in/2], element 2j in the low nibble and 2j+1 in the high one,
and `weight_scale` uint8 [out, ceil(in/32)], the E8M0 exponents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from mopd.model.config import MX_FORMAT_NAMES as MX_FORMATS

MXFormat = Literal["mxfp4", "mxfp8"]
BLOCK = 32
# bits a value costs on disk: its element plus its share of the block's 8-bit scale
BITS_PER_VALUE = {"mxfp4": 4 + 8 / BLOCK, "mxfp8": 8 + 8 / BLOCK}


def torchao_mx():
    """torchao's MX module, imported when first used (its import costs about a second)."""
    from torchao.prototype.mx_formats import mx_tensor

    return mx_tensor


def element_dtype(fmt: str) -> torch.dtype:
    if fmt == "mxfp4":
        return torch.float4_e2m1fn_x2
    if fmt == "mxfp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown MX format {fmt!r}; known: {', '.join(MX_FORMATS)}")


def quantize_dequantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` rounded to `fmt` in blocks of 32 along its last dimension, back in x's dtype (no gradient)."""
    mx = torchao_mx()
    with torch.no_grad():
        padded, width = pad_to_blocks(x.detach())
        hp = padded if padded.dtype in (torch.float32, torch.bfloat16) else padded.float()
        scale, data = mx.to_mx(hp.contiguous(), element_dtype(fmt), BLOCK)
        out = mx.to_dtype(data, scale, element_dtype(fmt), BLOCK, hp.dtype)
        return out[..., :width].to(x.dtype)


def fake_quantize(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """The forward sees `x` rounded to `fmt`; the backward passes the gradient straight through."""
    if fmt is None:
        return x
    return x + (quantize_dequantize(x, fmt) - x).detach()


def pad_to_blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    width = x.shape[-1]
    return F.pad(x, (0, -width % BLOCK)), width


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as (`weight_packed` uint8 [out, in/2], `weight_scale` uint8 [out, ceil(in/32)])."""
    if weight.dim() != 2 or weight.shape[-1] % 2:
        raise ValueError(f"MXFP4 packing needs a 2-D weight with an even input width, got {tuple(weight.shape)}")
    padded, width = pad_to_blocks(weight.detach().float())
    scale, data = torchao_mx().to_mx(padded.contiguous(), element_dtype("mxfp4"), BLOCK)
    return data[..., : width // 2].contiguous(), scale.view(torch.uint8).contiguous()


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight that `pack_mxfp4` stored, dequantized: equal to `quantize_dequantize(weight, "mxfp4")`."""
    width = packed.shape[-1] * 2
    padded = F.pad(packed, (0, scale.shape[-1] * BLOCK // 2 - packed.shape[-1]))
    e8m0 = scale.contiguous().view(torch.float8_e8m0fnu)
    out = torchao_mx().to_dtype(padded.contiguous(), e8m0, element_dtype("mxfp4"), BLOCK, torch.float32)
    return out[..., :width].to(dtype)


def unpack_mxfp4_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) with each MXFP4-packed weight (`W.weight_packed` and `W.weight_scale`)
    dequantized into `W.weight` (fp32): what the experts then compute on is exactly the MXFP4 values."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stem, _, part = name.rpartition(".")
        if part not in ("weight_packed", "weight_scale"):
            yield name, tensor
            continue
        pair = halves.setdefault(stem, {})
        pair[part] = tensor
        if len(pair) == 2:
            del halves[stem]
            yield f"{stem}.weight", unpack_mxfp4(pair["weight_packed"], pair["weight_scale"])
    if halves:
        raise ValueError(f"MXFP4 weights without their other half (weight_packed/weight_scale): {sorted(halves)}")


def is_mxfp4_packed(config: dict) -> bool:
    return (config.get("quantization_config") or {}).get("format") == "mxfp4-pack-quantized"


def packed_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes a weight of `shape` takes in `fmt`: elements plus one scale byte per (possibly partial) block."""
    *rows, width = shape
    count = 1
    for r in rows:
        count *= r
    element_bits = 4 if fmt == "mxfp4" else 8
    return count * (width * element_bits // 8 + -(-width // BLOCK))
