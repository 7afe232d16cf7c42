"""A stage's precision: fp32 throughout, or bf16 autocast where the machine runs bf16 natively.

    bf16_supported(device)            CUDA: torch's answer; CPU: AVX-512 BF16 or AMX-BF16 in its flags
    check_precision(p, device, field) refuses bf16 where it is not supported, naming the field
    autocast(device, p)               bf16: torch.autocast to bfloat16; fp32: nothing changes
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch

from mopd.recipe import RecipeError

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class PrecisionError(RecipeError):
    """bf16 asked for on a device that lacks it; the message names the field."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()}


def bf16_supported(device: str | torch.device, flags: Iterable[str] | None = None) -> bool:
    """Whether `device` runs bf16 natively: a CUDA device by torch's check; a CPU when it has AVX-512 BF16
    or AMX-BF16 (`flags`: the CPU's flags, default read from /proc/cpuinfo). Elsewhere torch emulates bf16, slowly."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(BF16_CPU_FLAGS & set(cpu_flags() if flags is None else flags))


def check_precision(precision: str | None, device: str | torch.device, field: str, supported: bool | None = None) -> None:
    """PrecisionError naming `field` when it asks for bf16 and `device` lacks it (`supported`: the answer of
    `bf16_supported`, computed when None)."""
    if precision != "bf16":
        return
    if supported is None:
        supported = bf16_supported(device)
    if not supported:
        needs = "a GPU with bf16 (Ampere or later; this one is not)" if torch.device(device).type == "cuda" else (
            "a CPU with AVX-512 BF16 or AMX (this one has neither)"
        )
        raise PrecisionError(f"{field}: bf16 needs {needs}; use fp32")


def autocast(device: str | torch.device, precision: str | None) -> contextlib.AbstractContextManager:
    """bf16: matmuls and the like run in bfloat16 under `torch.autocast` (weights stay as they are); fp32 or None: no change."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
