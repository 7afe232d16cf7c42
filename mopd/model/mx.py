"""OCP microscaling (MX) formats for the routed experts, from torchao: fake quantization for QAT and
the packed MXFP4 layout a quantized checkpoint stores.

An MX tensor splits its last dimension into blocks of 32 values that share one power-of-two scale
(E8M0); each value is an FP4 E2M1 (MXFP4) or an FP8 E4M3 (MXFP8) element. torchao's `to_mx` and
`to_dtype` define the rounding and pack the checkpoint; QAT's per-forward rounding restates them
without the packing (`quantize_dequantize`, bit-identical). torchao needs the last dimension to be a
multiple of 32; a tensor whose last dimension is not (the tiny preset's latent width is 48) gets a
final partial block: it is padded with zeros, which cannot raise a block's maximum, so the real
values quantize exactly as in a full block, and the padding is dropped again.

The packed layout is compressed-tensors' `mxfp4-pack-quantized` (what vLLM reads for Kimi K3's
experts): `weight_packed` uint8 [out, in/2], element 2j in the low nibble and 2j+1 in the high one,
and `weight_scale` uint8 [out, ceil(in/32)], the E8M0 exponents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from mopd.model.config import MX_FORMAT_NAMES as MX_FORMATS

BLOCK = 32
E2M1_MAX, E4M3_MAX = 6.0, 448.0
ELEMENT_MAX_EXPONENT = {"mxfp4": 2, "mxfp8": 8}  # log2 of the largest power of two each element holds


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
    """`x` rounded to `fmt` in blocks of 32 along its last dimension, back in x's dtype (no gradient).

    torchao's rounding (`to_mx` then `to_dtype`: the scale is the block maximum's power of two over the
    element's, values round to nearest even and saturate), restated without its packed FP4 detour:
    on CPU, to_mx packs FP4 nibbles that to_dtype unpacks again, 3-4x the time of the rounding
    alone, paid in every forward of QAT. tests/test_mx.py holds the two equal bit for bit."""
    element_dtype(fmt)  # refuses an unknown format by name
    with torch.no_grad():
        padded, width = pad_to_blocks(x.detach().float())
        blocks = padded.unflatten(-1, (-1, BLOCK))
        scale = block_scale(blocks.abs().amax(-1, keepdim=True), fmt)
        # as torchao: divide by a scale no smaller than the least normal float, multiply back by the true one
        values = round_to_element(blocks / scale.clamp(min=torch.finfo(torch.float32).tiny), fmt)
        return (values * scale).flatten(-2)[..., :width].to(x.dtype)


def block_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """2^(floor(log2 amax) − emax of the element), the E8M0 exponent clamped to [−127, 128]."""
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - ELEMENT_MAX_EXPONENT[fmt]
    return torch.exp2(exponent.clamp(-127, 128).float())


def round_to_element(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """v rounded to the nearest FP8 E4M3 or FP4 E2M1 value (ties to even), saturating at its maximum."""
    if fmt == "mxfp8":
        return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    magnitude = v.abs().clamp(max=E2M1_MAX)
    # E2M1's values are 0, 0.5 … 1.5 in steps of 0.5, then 2, 3, then 4, 6: round in units of the local step
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, v)


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
