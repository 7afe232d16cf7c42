"""The code domain: write a Python function `f` from a spec and examples; hidden unit tests decide.

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
                 step is not written, so the solver subtracts two terms (any difficulty)

The prompt shows the signature, the steps in words and `n_examples` examples. `meta` holds the
hidden tests (inputs AND expected outputs, computed by running the reference solution here, in
the trusted parent) plus the family and the reference code for the solver.

The expert's completion is `<think>…</think>` then the code in a ```python fence. Its scratchpad
grows with effort: empty at low; at high the plan as code lines and a check of one example; at
max each step in words and code, and a check of every example. (The max trace used to run every
example step by step in the scratchpad: a tiny model got those values wrong, and its code with
them: 0.19 at max against 0.62 at low on list_reduce.) A step whose constant
must be worked out (arith) writes that sum first at high and max, as the general domain does;
at low it is done in the head.

Train and eval never overlap: a task's canonical content is its reference code (which fixes the
function); its hash puts it in exactly one split (1 bucket of EVAL_BUCKETS is eval). Each split
draws from an RNG derived from (split, seed, index) and keeps only functions of its own bucket.
With `disjoint_eval=False` eval tasks are i.i.d. draws from another RNG stream: the same
functions may come back with other examples and tests (a held-out test of the trained
distribution, for models too small to write functions they have never seen).

Verification never trusts the program. The sandboxed child receives only the code, the entry
name, the hidden INPUTS and a per-run nonce; it calls `f` on each input and writes one
nonce-tagged record of plain JSON values. The expected outputs never enter the sandbox: the
parent parses the record (plain data only, whatever the child did to its own json or builtins)
and compares it, type-strictly, to the expected outputs. Exit status, prints, exceptions and
objects with a lying `__eq__` therefore cannot make a pass; only the right values can.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import random
import re
import secrets
from dataclasses import dataclass
from typing import Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.sandbox import Limits, Program, RunResult, Sandbox

FAMILIES = ("list_pipeline", "list_reduce", "string_ops", "string_count", "sequence", "poly", "arith")
EVAL_BUCKETS = 8
MAX_DRAWS = 1000
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


class CodeEnv:
    domain = "code"

    def __init__(
        self,
        families: tuple[str, ...] | list[str] = FAMILIES,
        difficulty: tuple[int, int] = (1, 3),
        max_len: int = 6,
        n_tests: int = 8,
        n_examples: int = 2,
        workers: int = 4,
        limits: Limits | None = None,
        backend: str = "auto",
        disjoint_eval: bool = True,
    ):
        self.families = tuple(families)
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"code: unknown families {unknown}; choose from {list(FAMILIES)}")
        low, high = difficulty
        if not 1 <= low <= high:
            raise ValueError(f"code: difficulty must be (low, high) with 1 <= low <= high, got {difficulty}")
        if max_len < 1 or n_tests < 1 or n_examples < 1:
            raise ValueError(
                f"code: max_len, n_tests, n_examples must be >= 1, got {max_len}, {n_tests}, {n_examples}"
            )
        self.difficulty = (low, high)
        self.max_len, self.n_tests, self.n_examples = max_len, n_tests, n_examples
        self.disjoint_eval = disjoint_eval
        self.sandbox_options = {"workers": workers, "limits": limits, "backend": backend}
        self._sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(**self.sandbox_options)
        return self._sandbox

    # ------------------------------------------------------------------------------ sampling
    def sample(self, n: int, seed: int, split: str = "train", effort: str = "high") -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {list(EFFORTS)}, got {effort!r}")
        return [self._task(split, seed, index, effort) for index in range(n)]

    def _task(self, split: str, seed: int, index: int, effort: str) -> Task:
        family = self.families[index % len(self.families)]
        rng = random.Random(f"code:{split}:{seed}:{index}")
        function = self._draw_function(family, split, rng)
        inputs = [edge_input(function.arg)] + [
            random_input(function.arg, rng, self.max_len) for _ in range(self.n_tests + self.n_examples - 1)
        ]
        reference = compile_reference(function.source)
        cases = [{"args": [value], "expected": reference(value)} for value in inputs]
        examples, tests = cases[-self.n_examples :], cases[: self.n_tests]
        meta = {
            "family": family,
            "entry": "f",
            "signature": function.signature,
            "steps": [[step.words, step.code, step.var, step.derivation] for step in function.steps],
            "arg": function.arg,
            "types": [function.arg_type, function.return_type],
            "examples": examples,
            "tests": tests,
            "content_hash": content_hash(function.source),
        }
        return Task(f"code-{split}-{seed}-{index}", self.domain, effort, prompt_for(function, examples), meta)

    def _draw_function(self, family: str, split: str, rng: random.Random) -> Function:
        for _ in range(MAX_DRAWS):
            function = FAMILY_BUILDERS[family](rng, rng.randint(*self.difficulty))
            if not self.disjoint_eval or split_of(function.source) == split:
                return function
        raise ValueError(f"code/{family}: difficulty {self.difficulty} leaves too few distinct functions")

    # ------------------------------------------------------------------------------- solving
    def solve(self, task: Task) -> str:
        function = function_from_meta(task.meta)
        thinking = trace(function, task.meta["examples"], task.effort)
        return f"{THINK_OPEN}{thinking}{THINK_CLOSE}\n```python\n{function.source}\n```"

    # ----------------------------------------------------------------------------- verifying
    def verify(self, task: Task, completion: str) -> Verdict:
        return self.verify_many([task], [completion])[0]

    def verify_many(self, tasks: list[Task], completions: list[str]) -> list[Verdict]:
        """Verify a batch; the sandbox runs the programs in parallel."""
        verdicts: list[Verdict | None] = []
        runs: list[tuple[int, Program, str]] = []
        for i, (task, completion) in enumerate(zip(tasks, completions, strict=True)):
            check_code_meta(task)
            code = extract_code(completion)
            if isinstance(code, Verdict):
                verdicts.append(code)
                continue
            nonce = secrets.token_hex(16)
            runs.append((i, harness_program(code, task, nonce), nonce))
            verdicts.append(None)
        results = self.sandbox.run_many([program for _, program, _ in runs])
        for (i, _, nonce), result in zip(runs, results):
            verdicts[i] = score(tasks[i], result, nonce, self.sandbox.backend)
        return verdicts  # type: ignore[return-value]

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


# ---------------------------------------------------------------------------------- families
def offset(expr: str, c: int) -> str:
    return expr if c == 0 else f"{expr} + {c}" if c > 0 else f"{expr} - {-c}"


def linear(a: int, b: int, var: str = "x") -> str:
    return offset(var if a == 1 else f"-{var}" if a == -1 else f"{a} * {var}", b)


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


def polynomial(rng: random.Random, degree: int) -> Step:
    coefficients = [rng.choice([-3, -2, -1, 1, 2, 3])] + [rng.randint(-5, 5) for _ in range(degree)]
    expr = ""
    for power, c in zip(range(degree, -1, -1), coefficients):
        if c == 0:
            continue
        factor = {0: "", 1: "n"}.get(power, f"n ** {power}")
        size = str(abs(c)) if not factor else factor if abs(c) == 1 else f"{abs(c)} * {factor}"
        sign = ("-" if c < 0 else "") if not expr else (" - " if c < 0 else " + ")
        expr += sign + size
    return Step(f"return {expr}", f"y = {expr}", "y")


def arithmetic_sequence(rng: random.Random) -> Step:
    start, step = rng.randint(0, 5), rng.randint(1, 4)
    terms = ", ".join(str(start + i * step) for i in range(3))
    return Step(
        f"return term n (counting from 0) of the sequence that begins {terms}",
        f"y = {linear(step, start, 'n')}",
        "y",
        f"{start + step}-{start}={step}",
    )


FAMILY_BUILDERS = {
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
    "arith": lambda rng, d: Function("n", "int", "int", (arithmetic_sequence(rng),)),
}


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


def content_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def split_of(source: str) -> str:
    return "eval" if int(content_hash(source)[:8], 16) % EVAL_BUCKETS == 0 else "train"


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


# ------------------------------------------------------------------------------------ traces
def trace(function: Function, examples: list[dict], effort: str) -> str:
    if effort == "low":
        return ""
    derivations = [step.derivation for step in function.steps if step.derivation]
    if effort == "high":
        plan = [*derivations, *(f"{i}. {step.code}" for i, step in enumerate(function.steps, 1))]
        case = examples[0]
        return "\n".join([*plan, f"check f({case['args'][0]!r}) == {case['expected']!r}"])
    lines = [f"f takes {function.arg} ({function.arg_type}) and returns {function.return_type}.", *derivations]
    lines += [f"step {i}: {step.words}: {step.code}" for i, step in enumerate(function.steps, 1)]
    lines += [f"check f({case['args'][0]!r}) == {case['expected']!r}" for case in examples]
    return "\n".join(lines)


# --------------------------------------------------------------------------------- verifying
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs inside the sandbox. It sees the candidate's code, the entry name, the inputs and the nonce;
# never the expected outputs. Whatever the candidate does to this process only changes what it
# writes, and the parent trusts nothing but plain JSON values that equal the expected ones.
# It imports only built-in modules (`import json` alone would double the cost of a run): the
# payload arrives marshalled, and `encode` writes JSON for plain values and refuses anything else.
HARNESS = r"""
import marshal, sys

def encode(value, depth=0):
    kind = type(value)
    if depth > 100:
        raise TypeError("nested too deep")
    if value is None or kind is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int:
        return str(value)
    if kind is float and value - value == 0:  # finite
        return repr(value)
    if kind is str:
        return '"' + "".join(map(encode_char, value)) + '"'
    if kind is list:
        return "[" + ",".join(encode(v, depth + 1) for v in value) + "]"
    if kind is dict and all(type(k) is str for k in value):
        return "{" + ",".join(encode(k) + ":" + encode(v, depth + 1) for k, v in value.items()) + "}"
    raise TypeError(f"returned a {kind.__name__}, not a plain list/dict/str/int/float/bool/None")

def encode_char(c):
    code = ord(c)
    if 32 <= code < 127:
        return "\\" + c if c in '"\\' else c
    if code < 0x10000:
        return "\\u%04x" % code
    code -= 0x10000
    return "\\u%04x\\u%04x" % (0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF))

def run(payload):
    namespace = {"__name__": "candidate"}
    try:
        exec(compile(payload["code"], "<candidate>", "exec"), namespace)
        function = namespace[payload["entry"]]
    except BaseException as exc:
        return '{"error":' + encode(f"defining the code failed: {type(exc).__name__}: {exc}"[:500]) + "}"
    cases = []
    for args in payload["inputs"]:
        try:
            cases.append('{"ok":' + encode(function(*args)) + "}")
        except BaseException as exc:
            cases.append('{"error":' + encode(f"{type(exc).__name__}: {exc}"[:200]) + "}")
    return '{"cases":[' + ",".join(cases) + "]}"

payload = marshal.loads(sys.stdin.buffer.read())
channel = sys.stdout
record = run(payload)
channel.write("\n" + payload["nonce"] + record + "\n")
channel.flush()
"""


def extract_code(completion: str) -> str | Verdict:
    parts = split_thinking(completion)
    if parts is None:
        return Verdict(0.0, {"reason": "no closed think block"})
    answer = strip_turn_end(parts[1])
    fenced = FENCED.search(answer)
    code = fenced.group(1) if fenced else answer
    if not code.strip():
        return Verdict(0.0, {"reason": "no code after </think>"})
    return code


def check_code_meta(task: Task) -> None:
    tests = task.meta.get("tests")
    if "entry" not in task.meta or not isinstance(tests, list) or not tests:
        raise ValueError(f"task {task.id}: code tasks need meta.entry and a non-empty meta.tests list")
    bad = [
        i
        for i, t in enumerate(tests)
        if not (isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t)
    ]
    if bad:
        raise ValueError(f"task {task.id}: meta.tests[{bad[0]}] must be {{'args': [...], 'expected': ...}}")


def harness_program(code: str, task: Task, nonce: str) -> Program:
    payload = {
        "code": code,
        "entry": task.meta["entry"],
        "inputs": [t["args"] for t in task.meta["tests"]],
        "nonce": nonce,
    }
    return Program(HARNESS, marshal.dumps(payload, 4))


def score(task: Task, result: RunResult, nonce: str, backend: str) -> Verdict:
    """Compare the child's one nonce-tagged record, parsed as plain data, to the expected outputs."""
    tests = task.meta["tests"]
    details: dict[str, Any] = {
        "status": result.status,
        "returncode": result.returncode,
        "sandbox": backend,
        "passed": 0,
        "total": len(tests),
    }
    records = [line[len(nonce) :] for line in result.stdout.splitlines() if line.startswith(nonce)]
    if len(records) != 1:
        return Verdict(
            0.0,
            {
                **details,
                "reason": f"{len(records)} result records (need exactly 1)",
                "stderr": result.stderr[-500:],
            },
        )
    try:
        record = json.loads(records[0])
    except (ValueError, RecursionError):
        return Verdict(0.0, {**details, "reason": "unreadable result record"})
    cases = record.get("cases") if isinstance(record, dict) else None
    if not isinstance(cases, list) or len(cases) != len(tests):
        error = record.get("error") if isinstance(record, dict) else None
        return Verdict(0.0, {**details, "reason": str(error or "malformed result record")[:500]})
    outcomes = [same_value(case, test["expected"]) for case, test in zip(cases, tests)]
    details["passed"] = sum(outcomes)
    if not all(outcomes):
        first = outcomes.index(False)
        details["failed"] = {"args": tests[first]["args"], "got": str(cases[first])[:300]}
    return Verdict(float(all(outcomes)), details)


def same_value(case: Any, expected: Any) -> bool:
    """Type-strict equality of plain JSON data (1, 1.0 and True differ)."""
    if not isinstance(case, dict) or "ok" not in case:
        return False
    return json.dumps(case["ok"], sort_keys=True) == json.dumps(expected, sort_keys=True)
