"""mul: a × b, digit by digit with carries for each digit of b, then the rows summed."""

from __future__ import annotations

import random

from mopd.envs.general.families.base import _column_lines, _digits_reversed, _number


def _gen_mul(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    return [_number(rng, knobs["mul_digits"]), _number(rng, knobs["mul_multiplier_digits"])], ["*"]


def _row_lines(a: int, digit: int) -> tuple[list[str], int]:
    steps, carry = [], 0
    for da in _digits_reversed(a):
        value = da * digit + carry
        steps.append((f"{da}*{digit}+{carry}", value))
        carry = value // 10
    lines = _column_lines(steps)
    if carry:
        lines.append(f"carry {carry}")
    return lines, a * digit


def mul_trace(terms: list[int], ops: list[str]) -> str:
    a, b = terms
    lines, rows = [], []
    for shift, digit in enumerate(_digits_reversed(b)):
        row_lines, row = _row_lines(a, digit)
        rows.append(row * 10**shift)
        lines += row_lines
        if b >= 10:
            lines.append(f"row {rows[-1]}")
    total = rows[0]
    for row in rows[1:]:
        lines.append(f"{total}+{row}={total + row}")
        total += row
    return "\n".join(lines)
