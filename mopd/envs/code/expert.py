"""The code domain's expert: its completions and the slips that make failed attempts.

The expert's completion is `<think>…</think>` then the code in a ```python fence. Its scratchpad
grows with effort: empty at low; at high the plan as code lines and a check of one example; at
max the signature in words first and a check of every example. (Longer max traces did worse on
a tiny model: running every example step by step, 0.19 at max against 0.62 at low on
list_reduce; every step in words and code, the base with attempts 0.41 at max against 0.52 at high.) A
step whose constant must be worked out (arith) writes that sum first at high and max, as the
general domain does; at low it is done in the head.
"""

from __future__ import annotations

import random
from dataclasses import replace

from mopd.envs.base import THINK_CLOSE, THINK_OPEN
from mopd.envs.code.function import Function


def completion_of(function: Function, examples: list[dict], effort: str) -> str:
    return f"{THINK_OPEN}{trace(function, examples, effort)}{THINK_CLOSE}\n```python\n{function.source}\n```"


def slip(function: Function, rng: random.Random) -> Function | None:
    """The function with one digit of one step's code changed; None when no step has a digit."""
    places = [(i, pos) for i, step in enumerate(function.steps) for pos, c in enumerate(step.code) if c.isdigit()]
    if not places:
        return None
    i, pos = rng.choice(places)
    code = function.steps[i].code
    changed = code[:pos] + rng.choice([d for d in "0123456789" if d != code[pos]]) + code[pos + 1 :]
    steps = list(function.steps)
    steps[i] = replace(steps[i], code=changed)
    return replace(function, steps=tuple(steps))


def trace(function: Function, examples: list[dict], effort: str) -> str:
    if effort == "low":
        return ""
    derivations = [step.derivation for step in function.steps if step.derivation]
    plan = [*derivations, *(f"{i}. {step.code}" for i, step in enumerate(function.steps, 1))]
    checks = [f"check f({case['args'][0]!r}) == {case['expected']!r}" for case in examples]
    if effort == "high":
        return "\n".join([*plan, checks[0]])
    return "\n".join([f"f takes {function.arg} ({function.arg_type}) and returns {function.return_type}.", *plan, *checks])
