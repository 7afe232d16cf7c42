"""Helpers the own families share: a number of some digits, and one trace line per column."""

from __future__ import annotations

import random


def _number(rng: random.Random, digits: tuple[int, int]) -> int:
    width = rng.randint(*digits)
    return rng.randint(0 if width == 1 else 10 ** (width - 1), 10**width - 1)


def _digits_reversed(number: int) -> list[int]:
    return [int(d) for d in reversed(str(number))]


def _column_lines(steps: list[tuple[str, int]]) -> list[str]:
    """One line per column: 'expr=sum'."""
    return [f"{expr}={value}" for expr, value in steps]
