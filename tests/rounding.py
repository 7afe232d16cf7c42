"""Tolerances for half-precision parity that come from rounding, not from one machine's error.

Two implementations of one computation in a half dtype each round differently (kernels, fused
ops, AVX-512 FP16/AMX or not), so their distance from each other is no fixed number. What holds on
every CPU: each stays about as far from the exact (fp32) result as the other. So the engine's
log-probs may be at most twice as far from the fp32 model's as HF's own in the same dtype are on the
same tokens (two roundings of one computation), plus one unit of the dtype's epsilon (a rounding of
the output itself, which matters where HF's error happens to be near 0). A wrong kernel, weight or
cache is off by orders more.
"""

from __future__ import annotations

import torch


def relative_error(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logprobs - reference).abs() / reference.abs()).max().item()


def rounding_tolerance(half: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The bound for another implementation in `dtype`: 2 × HF-in-`dtype`'s relative error from fp32, + ε."""
    return 2 * relative_error(half, exact) + torch.finfo(dtype).eps


def assert_within_rounding(engine: torch.Tensor, half: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The engine's log-probs are as close to fp32 as HF's in `dtype` are (above); returns the bound."""
    bound = rounding_tolerance(half, exact, dtype)
    error = relative_error(engine, exact)
    assert error <= bound, f"{dtype}: engine error {error:.3g} from fp32 > bound {bound:.3g} (HF {relative_error(half, exact):.3g})"
    return bound
