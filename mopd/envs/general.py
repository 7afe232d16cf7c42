"""The general domain: questions with exact answers, scored by parsing what follows `</think>`.

Our own families come with step-by-step traces, where thinking truly helps a tiny model:
  add    a + b, column by column with carries
  mul    a × b, digit by digit with carries for each digit of b, then the rows summed
  chain  a + b − c + …, with a running total
Each has difficulty knobs (digits, multiplier digits, chain length). Effort decides how much
work the expert writes out, one line per step, the same lines at every effort: at low only sums of
at most `low_chain_terms` one-digit terms (other answers come straight away), at high also longer
sums and products of terms with at most `high_term_digits` digits (any, by default) but chains of at
most `high_chain_terms` terms, at max everything. So what high leaves out is answered from the head
below max effort, and max effort pays where the work does not fit high's scratchpad. (A model
of ~1M parameters answers even 1 + 7 straight away only by chance, the tiny base did so 5% of the
time, so RL at low effort saw no reward to sharpen. Max once wrote the same steps as high with
labels and running results added, `step 1: 4+7=11 so far 1`; the tiny student did worse with them,
0.77 against 0.85 at high, and the labels' digits leaked into the sums.)

Reasoning-gym families are named `rg/<name>` (e.g. `rg/gcd`) and are scored by reasoning-gym's
own scorer; they have no trace, so the expert writes a short think block and the gold answer.

Train, dev and test never share a question (`mopd.envs.splits`): a task's key is the hash of its
normalised question and answer, whichever family drew it ("Compute 3 + 5." is one task for `add`
and `chain`), and the key puts it in exactly one split. Each split draws candidates from an RNG
derived from (split, seed, index) and keeps only those of its own split, so no seed, family or
sample size can put one question into two splits. The key is `task.meta["content_hash"]`.
A train question is drawn only where its worked steps state no dev or test question (`contents`):
the sums of a chain's trace and the columns of an addition are questions of their own.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
from collections.abc import Iterator
from typing import Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.splits import check_split, content_hash, split_of, trainable

OWN_FAMILIES = ("add", "mul", "chain")
RG_PREFIX = "rg/"
DEFAULT_FAMILIES = (*OWN_FAMILIES, "rg/basic_arithmetic", "rg/gcd")
MAX_DRAWS = 1000
RG_CHUNK = 256


class GeneralEnv:
    domain = "general"

    def __init__(
        self,
        families: tuple[str, ...] | list[str] = DEFAULT_FAMILIES,
        add_digits: tuple[int, int] = (1, 6),
        mul_digits: tuple[int, int] = (1, 4),
        mul_multiplier_digits: tuple[int, int] = (1, 1),
        chain_terms: tuple[int, int] = (2, 6),
        chain_digits: tuple[int, int] = (1, 3),
        high_chain_terms: int = 4,
        low_chain_terms: int = 3,
        high_term_digits: int | None = None,
        rg_options: dict[str, dict[str, Any]] | None = None,
    ):
        self.families = tuple(families)
        unknown = [f for f in self.families if f not in OWN_FAMILIES and not f.startswith(RG_PREFIX)]
        if unknown or not self.families:
            raise ValueError(f"general: unknown families {unknown}; use {list(OWN_FAMILIES)} or 'rg/<name>'")
        self.knobs = {
            "add_digits": _checked_range("add_digits", add_digits),
            "mul_digits": _checked_range("mul_digits", mul_digits),
            "mul_multiplier_digits": _checked_range("mul_multiplier_digits", mul_multiplier_digits),
            "chain_terms": _checked_range("chain_terms", chain_terms, low=2),
            "chain_digits": _checked_range("chain_digits", chain_digits),
        }
        if high_chain_terms < 2:
            raise ValueError(f"general: high_chain_terms={high_chain_terms} must be at least 2")
        if low_chain_terms < 2:
            raise ValueError(f"general: low_chain_terms={low_chain_terms} must be at least 2")
        if high_term_digits is not None and high_term_digits < 1:
            raise ValueError(f"general: high_term_digits={high_term_digits} must be at least 1")
        self.high_chain_terms = high_chain_terms
        self.low_chain_terms, self.high_term_digits = low_chain_terms, high_term_digits
        self.rg_options = rg_options or {}
        for family in self.families:
            if family.startswith(RG_PREFIX):
                _rg_dataset(family.removeprefix(RG_PREFIX), _config_key(self.rg_config(family)))

    # ------------------------------------------------------------------------------- sampling
    def sample(self, n: int, seed: int, split: str = "train", effort: str = "high") -> list[Task]:
        check_split(split)
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {list(EFFORTS)}, got {effort!r}")
        rg_streams = {
            family: self._rg_stream(family, split, seed)
            for family in self.families
            if family.startswith(RG_PREFIX)
        }
        tasks = []
        for index in range(n):
            family = self.families[index % len(self.families)]
            if family in rg_streams:
                question, answer, extra = next(rg_streams[family])
            else:
                question, answer, extra = self._draw_own(family, split, seed, index)
            meta = {"family": family, "answer": answer, "content_hash": task_key(question, answer), **extra}
            tasks.append(Task(f"general-{split}-{seed}-{index}", self.domain, effort, question, meta))
        return tasks

    def _draw_own(self, family: str, split: str, seed: int, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = random.Random(f"general:{split}:{seed}:{index}")
        for _ in range(MAX_DRAWS):
            terms, ops = OWN_GENERATORS[family](rng, self.knobs)
            question, answer = question_for(terms, ops), str(evaluate(terms, ops))
            if split_of(task_key(question, answer)) == split and (split != "train" or self._trainable(family, terms, ops)):
                return question, answer, {"terms": terms, "ops": ops}
        raise ValueError(
            f"general/{family}: difficulty knobs {self.knobs} leave too few distinct {split} questions "
            f"({MAX_DRAWS} draws found none)"
        )

    @staticmethod
    def _trainable(family: str, terms: list[int], ops: list[str]) -> bool:
        """A train question's worked steps (max effort writes them all) state only train questions:
        `12+5=17` in a chain's trace is the question "Compute 12 + 5." answered."""
        return trainable(contents(TRACES[family](terms, ops)))

    def _rg_stream(self, family: str, split: str, seed: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """reasoning-gym items of this split, drawn from fixed-size chunks (some families build all
        `size` items up front, so the size must not grow with n)."""
        name, config = family.removeprefix(RG_PREFIX), self.rg_config(family)
        for chunk in itertools.count():
            key = f"{split}:{seed}:{family}:{chunk}"
            dataset = _rg_create(
                name, config, int(hashlib.sha256(key.encode()).hexdigest()[:8], 16), RG_CHUNK
            )
            found = 0
            for index in range(RG_CHUNK):
                entry = json.loads(json.dumps(dataset[index], default=str))
                if split_of(task_key(entry["question"], entry["answer"])) == split:
                    found += 1
                    yield entry["question"], entry["answer"], {"rg_config": config, "rg_entry": entry}
            if not found:
                raise ValueError(f"general/{family}: {RG_CHUNK} reasoning-gym items gave no {split} question")

    def rg_config(self, family: str) -> dict[str, Any]:
        return self.rg_options.get(family.removeprefix(RG_PREFIX), {})

    # ---------------------------------------------------------------------------- verification
    def verify(self, task: Task, completion: str) -> Verdict:
        parts = split_thinking(completion)
        if parts is None:
            return Verdict(0.0, {"reason": "no closed think block"})
        answer = strip_turn_end(parts[1])
        family = task.meta.get("family", "exact")
        if family.startswith(RG_PREFIX):
            return _verify_rg(task, answer)
        expected = task.meta.get("answer")
        if expected is None:
            raise ValueError(f"task {task.id}: meta has no 'answer' to check against")
        got = normalize_answer(answer)
        reward = float(got == normalize_answer(str(expected)))
        return Verdict(reward, {"family": family, "expected": str(expected), "got": got})

    # ------------------------------------------------------------------------------ the expert
    def solve(self, task: Task) -> str:
        family = task.meta["family"]
        if family.startswith(RG_PREFIX):
            thinking = "" if task.effort == "low" else f"The answer is {task.meta['answer']}."
        elif self.works_out(task.effort, task.meta["terms"]):
            thinking = TRACES[family](task.meta["terms"], task.meta["ops"])
        else:
            thinking = ""
        return f"{THINK_OPEN}{thinking}{THINK_CLOSE}{task.meta['answer']}"

    def works_out(self, effort: str, terms: list[int]) -> bool:
        """Whether the expert writes the steps at this effort, or answers straight away. Low writes
        only one-digit terms: three of them take ~14 tokens, inside its default budget of 16."""
        if effort == "low":
            return len(terms) <= self.low_chain_terms and max_digits(terms) == 1
        if effort == "high":
            short = len(terms) <= self.high_chain_terms
            return short and (self.high_term_digits is None or max_digits(terms) <= self.high_term_digits)
        return True


# ---------------------------------------------------------------------------------- generators
def _checked_range(name: str, bounds: tuple[int, int], low: int = 1) -> tuple[int, int]:
    lo, hi = bounds
    if not (low <= lo <= hi):
        raise ValueError(f"general: {name}={bounds} must satisfy {low} <= min <= max")
    return int(lo), int(hi)


def _number(rng: random.Random, digits: tuple[int, int]) -> int:
    width = rng.randint(*digits)
    return rng.randint(0 if width == 1 else 10 ** (width - 1), 10**width - 1)


def _gen_add(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    return [_number(rng, knobs["add_digits"]), _number(rng, knobs["add_digits"])], ["+"]


def _gen_mul(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    return [_number(rng, knobs["mul_digits"]), _number(rng, knobs["mul_multiplier_digits"])], ["*"]


def _gen_chain(rng: random.Random, knobs: dict) -> tuple[list[int], list[str]]:
    count = rng.randint(*knobs["chain_terms"])
    terms = [_number(rng, knobs["chain_digits"]) for _ in range(count)]
    return terms, [rng.choice("+-") for _ in range(count - 1)]


OWN_GENERATORS = {"add": _gen_add, "mul": _gen_mul, "chain": _gen_chain}


def question_for(terms: list[int], ops: list[str]) -> str:
    expression = str(terms[0]) + "".join(f" {op} {term}" for op, term in zip(ops, terms[1:]))
    return f"Compute {expression}."


def evaluate(terms: list[int], ops: list[str]) -> int:
    total = terms[0]
    for op, term in zip(ops, terms[1:]):
        total = total * term if op == "*" else total + term if op == "+" else total - term
    return total


def task_key(question: str, answer: Any) -> str:
    """The split key: the question and the answer (as the verifier reads it), not the family that drew them."""
    return content_hash(question, normalize_answer(str(answer)))


QUESTION = re.compile(r"Compute (-?\d+(?: [-+*] -?\d+)*)\.")
EQUATION = re.compile(r"(?<![\w.])(-?\d+(?:[-+*]\d+)+)=-?\d+(?![\d.])")
OPERATION = re.compile(r"\s*([-+*])\s*(-?\d+)")


def contents(text: str) -> set[str]:
    """The questions a text states, answered: each "Compute …." question, and each worked sum of a
    trace (`4+7+1=12`, the question "Compute 4 + 7 + 1."), keyed as the task of that question is
    (`task_key`, with the true answer whatever the text wrote). reasoning-gym questions have no
    common form: their key is the task's own."""
    expressions = QUESTION.findall(text) + EQUATION.findall(text)
    return {task_key(question_for(terms, ops), evaluate(terms, ops)) for terms, ops in map(parse_expression, expressions)}


def parse_expression(expression: str) -> tuple[list[int], list[str]]:
    first = re.match(r"\s*(-?\d+)", expression)
    pairs = OPERATION.findall(expression[first.end():])
    return [int(first.group(1)), *(int(term) for _, term in pairs)], [op for op, _ in pairs]


# -------------------------------------------------------------------------------------- traces
def _digits_reversed(number: int) -> list[int]:
    return [int(d) for d in reversed(str(number))]


def _column_lines(steps: list[tuple[str, int]]) -> list[str]:
    """One line per column: 'expr=sum'."""
    return [f"{expr}={value}" for expr, value in steps]


def add_trace(terms: list[int], ops: list[str]) -> str:
    a, b = _digits_reversed(terms[0]), _digits_reversed(terms[1])
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    steps, carry = [], 0
    for da, db in zip(a, b):
        value = da + db + carry
        steps.append((f"{da}+{db}+{carry}", value))
        carry = value // 10
    lines = _column_lines(steps)
    if carry:
        lines.append(f"carry {carry}")
    return "\n".join(lines)


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


def chain_trace(terms: list[int], ops: list[str]) -> str:
    lines, total = [], terms[0]
    for op, term in zip(ops, terms[1:]):
        new_total = evaluate([total, term], [op])
        lines.append(f"{total}{op}{term}={new_total}")
        total = new_total
    return "\n".join(lines)


TRACES = {"add": add_trace, "mul": mul_trace, "chain": chain_trace}


def max_digits(terms: list[int]) -> int:
    """Digits of the longest term."""
    return max(len(str(abs(term))) for term in terms)


# ----------------------------------------------------------------------------------- answers
NUMBER = re.compile(r"[+-]?\d[\d,_ ]*")


def normalize_answer(text: str) -> str:
    """Canonical answer text: no padding or final period; numbers without separators or sign '+'."""
    text = " ".join(text.replace("\u2212", "-").split()).removesuffix(".")
    if NUMBER.fullmatch(text):
        return str(int(re.sub(r"[,_ ]", "", text)))
    return text


# ------------------------------------------------------------------------------- reasoning-gym
def _config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _rg_create(name: str, config: dict[str, Any], seed: int, size: int) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except Exception as error:
        raise ValueError(
            f"general: reasoning-gym family {name!r} with options {config} failed: {error}"
        ) from error


@functools.lru_cache(maxsize=64)
def _rg_dataset(name: str, config_key: str) -> Any:
    """One scorer instance per (family, options); scoring does not depend on the seed."""
    return _rg_create(name, json.loads(config_key), seed=0, size=1)


def _verify_rg(task: Task, answer: str) -> Verdict:
    name = task.meta["family"].removeprefix(RG_PREFIX)
    entry = task.meta.get("rg_entry")
    if entry is None:
        raise ValueError(f"task {task.id}: reasoning-gym family {name!r} needs meta['rg_entry']")
    scorer = _rg_dataset(name, _config_key(task.meta.get("rg_config", {})))
    reward = float(scorer.score_answer(answer, entry))
    return Verdict(
        min(max(reward, 0.0), 1.0),
        {"family": task.meta["family"], "expected": entry["answer"], "got": answer},
    )
