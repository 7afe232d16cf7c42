"""chain: a + b − c + …, with a running total."""

from __future__ import annotations

import random

from mopd.envs.general.families.base import _number
from mopd.envs.general.questions import evaluate


def _gen_chain(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    count = rng.randint(*knobs["chain_terms"])
    terms = [_number(rng, knobs["chain_digits"]) for _ in range(count)]
    return terms, [rng.choice("+-") for _ in range(count - 1)]


def chain_trace(terms: list[int], ops: list[str]) -> str:
    lines, total = [], terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        new_total = evaluate([total, term], [op])
        lines.append(f"{total}{op}{term}={new_total}")
        total = new_total
    return "\n".join(lines)
