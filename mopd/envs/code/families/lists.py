"""list_pipeline and list_reduce: list steps (map, filter, sort, take, differences, running sums),
then for list_reduce a sum / count / max / min."""

from __future__ import annotations

import random

from mopd.envs.code.function import Step, linear


def list_step(rng: random.Random) -> Step:
    kind = rng.choice(
        ["map", "mod", "above", "reverse", "sort", "take", "drop", "abs", "diff", "prefix", "window"]
    )
    a, b, k, t = rng.choice([-3, -2, -1, 2, 3, 4]), rng.randint(-5, 5), rng.randint(2, 4), rng.randint(-3, 5)
    r = rng.randint(0, k - 1)
    steps = {
        "map": (f"replace each x by {linear(a, b)}", f"[{linear(a, b)} for x in xs]"),
        "mod": (f"keep the x with x % {k} == {r}", f"[x for x in xs if x % {k} == {r}]"),
        "above": (f"keep the x greater than {t}", f"[x for x in xs if x > {t}]"),
        "reverse": ("reverse the list", "xs[::-1]"),
        "sort": ("sort ascending", "sorted(xs)"),
        "take": (f"keep the first {k} elements", f"xs[:{k}]"),
        "drop": (f"drop the first {k - 1} elements", f"xs[{k - 1}:]"),
        "abs": ("replace each x by its absolute value", "[abs(x) for x in xs]"),
        "diff": (
            "replace the list by the differences next minus current",
            "[b - a for a, b in zip(xs, xs[1:])]",
        ),
        "prefix": ("replace the list by its running sums", "[sum(xs[:i + 1]) for i in range(len(xs))]"),
        "window": (
            f"replace the list by the sums of each {k} neighbours",
            f"[sum(xs[i:i + {k}]) for i in range(len(xs) - {k - 1})]",
        ),
    }
    words, expr = steps[kind]
    return Step(words, f"xs = {expr}", "xs")


def list_reducer(rng: random.Random) -> Step:
    t = rng.randint(-3, 5)
    words, expr = rng.choice(
        [
            ("return the sum", "sum(xs)"),
            ("return the number of elements", "len(xs)"),
            ("return the largest element, or 0 if there is none", "max(xs, default=0)"),
            ("return the smallest element, or 0 if there is none", "min(xs, default=0)"),
            (f"return how many x are greater than {t}", f"sum(1 for x in xs if x > {t})"),
        ]
    )
    return Step(words, f"y = {expr}", "y")
