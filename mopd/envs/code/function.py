"""A generated code function: its steps, its source, the inputs it is tested on and its prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

ALPHABET = "abcdeo"  # few letters, so replace/count steps usually hit something


@dataclass(frozen=True)
class Step:
    words: str
    code: str  # one statement assigning `var`
    var: str
    derivation: str = ""  # the arithmetic that gives the code's constant, when the words leave it out


@dataclass(frozen=True)
class Function:
    arg: str  # the single argument: xs, s or n
    arg_type: str
    return_type: str
    steps: tuple[Step, ...]

    @property
    def source(self) -> str:
        body = [f"    {step.code}" for step in self.steps] + [f"    return {self.steps[-1].var}"]
        return "\n".join([f"def f({self.arg}):", *body])

    @property
    def signature(self) -> str:
        return f"def f({self.arg}: {self.arg_type}) -> {self.return_type}:"


def offset(expr: str, c: int) -> str:
    return expr if c == 0 else f"{expr} + {c}" if c > 0 else f"{expr} - {-c}"


def linear(a: int, b: int, var: str = "x") -> str:
    return offset(var if a == 1 else f"-{var}" if a == -1 else f"{a} * {var}", b)


def edge_input(arg: str) -> Any:
    return {"xs": [], "s": "", "n": 0}[arg]


def random_input(arg: str, rng: random.Random, max_len: int) -> Any:
    if arg == "xs":
        return [rng.randint(-9, 9) for _ in range(rng.randint(1, max_len))]
    if arg == "s":
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, max_len)))
    return rng.randint(1, max_len)


def compile_reference(source: str):
    """Our own generated code, run here in the trusted parent to compute the expected outputs."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace["f"]


def prompt_for(function: Function, examples: list[dict]) -> str:
    steps = "; then ".join(step.words for step in function.steps)
    shown = "\n".join(f"f({case['args'][0]!r}) == {case['expected']!r}" for case in examples)
    return f"Write this Python function.\n{function.signature}\nIt should: {steps}.\nExamples:\n{shown}"


def function_from_meta(meta: dict) -> Function:
    if not {"steps", "arg", "types"} <= meta.keys():
        raise ValueError(
            "code: only generated tasks (meta.steps, meta.arg, meta.types) have a reference solution"
        )
    steps = tuple(Step(*step) for step in meta["steps"])
    return Function(meta["arg"], *meta["types"], steps)
