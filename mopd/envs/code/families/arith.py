"""arith and linear: term n of an arithmetic sequence, shown by its first three terms (arith: the
step is derived by a subtraction, written first at high and max) or stated in words (linear)."""

from __future__ import annotations

import random

from mopd.envs.code.function import Function, Step, linear


def arithmetic_sequence(
    rng: random.Random, starts: tuple[int, int] = (0, 5), steps: tuple[int, int] = (1, 4), stated: bool = False
) -> Step:
    """Term n of start + n * step: shown by its first three terms (the step to derive), or `stated` in words."""
    start, step = rng.randint(*starts), rng.randint(*steps)
    code = f"y = {linear(step, start, 'n')}"
    if stated:
        return Step(f"return term n (counting from 0) of the sequence that starts at {start} and adds {step} each time", code, "y")
    terms = ", ".join(str(start + i * step) for i in range(3))
    return Step(f"return term n (counting from 0) of the sequence that begins {terms}", code, "y", f"{start + step}-{start}={step}")


def arith_function(
    rng: random.Random, starts: tuple[int, int] = (0, 5), steps: tuple[int, int] = (1, 4), stated: bool = False
) -> Function:
    return Function("n", "int", "int", (arithmetic_sequence(rng, starts, steps, stated),))
