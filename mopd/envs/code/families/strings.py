"""string_ops and string_count: string steps (reverse, upper, replace, remove, sort, double, take,
rotate), then for string_count a count."""

from __future__ import annotations

import random

from mopd.envs.code.function import ALPHABET, Step


def string_step(rng: random.Random) -> Step:
    c1, c2 = rng.sample(ALPHABET, 2)
    k = rng.randint(1, 3)
    words, expr = rng.choice(
        [
            ("reverse the string", "s[::-1]"),
            ("make it upper case", "s.upper()"),
            (f"replace every '{c1}' by '{c2}'", f"s.replace('{c1}', '{c2}')"),
            (f"remove every '{c1}'", f"s.replace('{c1}', '')"),
            ("sort the characters", "''.join(sorted(s))"),
            ("write every character twice", "''.join(c * 2 for c in s)"),
            (f"keep the first {k} characters", f"s[:{k}]"),
            (f"move the first {k} characters to the end", f"s[{k}:] + s[:{k}]"),
        ]
    )
    return Step(words, f"s = {expr}", "s")


def string_counter(rng: random.Random) -> Step:
    c = rng.choice(ALPHABET)
    words, expr = rng.choice(
        [
            (f"return how many times '{c}' occurs", f"s.count('{c}')"),
            ("return the number of vowels", "sum(1 for c in s if c in 'aeiou')"),
            ("return the length", "len(s)"),
            ("return the number of distinct characters", "len(set(s))"),
        ]
    )
    return Step(words, f"y = {expr}", "y")
