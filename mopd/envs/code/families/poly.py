"""poly: a polynomial in n of degree `difficulty` (at most 3)."""

from __future__ import annotations

import random

from mopd.envs.code.function import Step


def polynomial(rng: random.Random, degree: int) -> Step:
    coefficients = [rng.choice([-3, -2, -1, 1, 2, 3])] + [rng.randint(-5, 5) for _ in range(degree)]
    expr = ""
    for power, c in zip(range(degree, -1, -1), coefficients, strict=True):
        if c == 0:
            continue
        factor = {0: "", 1: "n"}.get(power, f"n ** {power}")
        size = str(abs(c)) if not factor else factor if abs(c) == 1 else f"{abs(c)} * {factor}"
        sign = ("-" if c < 0 else "") if not expr else (" - " if c < 0 else " + ")
        expr += sign + size
    return Step(f"return {expr}", f"y = {expr}", "y")
