"""sequence: an arithmetic / geometric / square sequence of n terms, then list steps."""

from __future__ import annotations

import random

from mopd.envs.code.function import Step, linear, offset


def sequence_start(rng: random.Random) -> Step:
    a, d, r, c = (
        rng.randint(-5, 5),
        rng.choice([-3, -2, -1, 1, 2, 3, 4]),
        rng.randint(2, 3),
        rng.randint(-3, 3),
    )
    words, expr = rng.choice(
        [
            (
                f"the first n terms of the sequence that starts at {a} and adds {d} each time",
                f"[{linear(d, a, 'i')} for i in range(n)]",
            ),
            (
                f"the first n terms of the sequence that starts at {d} and multiplies by {r} each time",
                f"[{d} * {r} ** i for i in range(n)]",
            ),
            (
                f"the list of {offset('i * i', c)} for i from 0 to n - 1",
                f"[{offset('i * i', c)} for i in range(n)]",
            ),
        ]
    )
    return Step(f"make {words}", f"xs = {expr}", "xs")
