"""The code domain's task families and its one builder table.

Task families are templated pipelines: a function body is a few one-line steps, each rewriting
one variable, then `return` of the last one. A tiny model can learn them, and the difficulty knob
is the number of steps.

  list_pipeline  f(xs) -> list: steps such as map, filter, sort, take, differences, running sums
  list_reduce    f(xs) -> int: (difficulty - 1) list steps, then a sum / count / max / min
  string_ops     f(s) -> str: reverse, upper, replace, remove, sort, double, take, rotate
  string_count   f(s) -> int: (difficulty - 1) string steps, then a count
  sequence       f(n) -> list: an arithmetic / geometric / square sequence, then list steps
  poly           f(n) -> int: a polynomial of degree `difficulty`
  arith          f(n) -> int: term n of an arithmetic sequence shown by its first three terms; the
                 step is not written, so the solver subtracts two terms (any difficulty). The first
                 term and the step are drawn from `arith_start` and `arith_step`: the wider they are,
                 the more functions there are to hold out
  linear         f(n) -> int: term n of an arithmetic sequence given by its start and its step in
                 words (`arith_start`, `arith_step`): the body is the rule `step * n + start` applied
                 to two numbers of the prompt, with no subtraction to do first

Each family module holds the steps its functions are made of; adding a family is adding one module
and one line to `family_builders` (and its name to `FAMILIES`).
"""

from __future__ import annotations

from mopd.envs.code.families.arith import arith_function
from mopd.envs.code.families.lists import list_reducer, list_step
from mopd.envs.code.families.poly import polynomial
from mopd.envs.code.families.sequence import sequence_start
from mopd.envs.code.families.strings import string_counter, string_step
from mopd.envs.code.function import Function

FAMILIES = ("list_pipeline", "list_reduce", "string_ops", "string_count", "sequence", "poly", "arith", "linear")


def family_builders(arith_start: tuple[int, int] = (0, 5), arith_step: tuple[int, int] = (1, 4)) -> dict:
    """The domain's one builder table: family → (rng, difficulty) → Function, with the env's ranges."""
    return {
        "list_pipeline": lambda rng, d: Function(
            "xs", "list[int]", "list[int]", tuple(list_step(rng) for _ in range(d))
        ),
        "list_reduce": lambda rng, d: Function(
            "xs", "list[int]", "int", (*(list_step(rng) for _ in range(d - 1)), list_reducer(rng))
        ),
        "string_ops": lambda rng, d: Function("s", "str", "str", tuple(string_step(rng) for _ in range(d))),
        "string_count": lambda rng, d: Function(
            "s", "str", "int", (*(string_step(rng) for _ in range(d - 1)), string_counter(rng))
        ),
        "sequence": lambda rng, d: Function(
            "n", "int", "list[int]", (sequence_start(rng), *(list_step(rng) for _ in range(d - 1)))
        ),
        "poly": lambda rng, d: Function("n", "int", "int", (polynomial(rng, min(d, 3)),)),
        "arith": lambda rng, d: arith_function(rng, arith_start, arith_step),
        "linear": lambda rng, d: arith_function(rng, arith_start, arith_step, stated=True),
    }
