"""add: a + b, column by column with carries."""

from __future__ import annotations

import random

from mopd.envs.general.families.base import _column_lines, _digits_reversed, _number


def _gen_add(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    return [_number(rng, knobs["add_digits"]), _number(rng, knobs["add_digits"])], ["+"]


def add_trace(terms: list[int], ops: list[str]) -> str:
    a, b = _digits_reversed(terms[0]), _digits_reversed(terms[1])
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    steps, carry = [], 0
    for da, db in zip(a, b, strict=True):
        value = da + db + carry
        steps.append((f"{da}+{db}+{carry}", value))
        carry = value // 10
    lines = _column_lines(steps)
    if carry:
        lines.append(f"carry {carry}")
    return "\n".join(lines)
