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
                 step is not written, so the solver subtracts two terms (any difficulty). The first
                 term and the step are drawn from `arith_start` and `arith_step`: the wider they are,
                 the more functions there are to hold out
  linear         f(n) -> int: term n of an arithmetic sequence given by its start and its step in
                 words (`arith_start`, `arith_step`): the body is the rule `step * n + start` applied
                 to two numbers of the prompt, with no subtraction to do first

The prompt shows the signature, the steps in words and `n_examples` examples. `meta` holds the
hidden tests (inputs AND expected outputs, computed by running the reference solution here, in
the trusted parent) plus the family and the reference code for the solver.

Attempts grow with effort (`attempts`, default low 1, high 2, max 3). An attempt is one
assistant turn: `<think>…</think>` then the code. Above low effort the environment runs an
attempt on the prompt's examples in the sandbox, as a programmer runs the examples they were
given: if they all pass, or the attempts are used up, the episode ends; otherwise an observation
says what the code returned for the failing examples (`f(2) returned 5, expected 4`) and the
model writes the function again. The hidden tests judge the last attempt. This is where effort
pays in code: a tiny model's second and third tries, told what went wrong, pass where its first
did not. The expert's transcripts show it: with `retry_demos` = p, that fraction of the
high/max transcripts starts with a failed attempt (a constant of the solution changed, or
another train function of the family), the observation the environment gives for it, and then the
right function. A failed attempt never shows a dev or test function (`mopd.envs.splits.trainable`;
`contents` lists the functions a text states, for the audit).

The expert's completion is `<think>…</think>` then the code in a ```python fence. Its scratchpad
grows with effort: empty at low; at high the plan as code lines and a check of one example; at
max the signature in words first and a check of every example. (Longer max traces did worse on
a tiny model: running every example step by step, 0.19 at max against 0.62 at low on
list_reduce; every step in words and code, the base with attempts 0.41 at max against 0.52 at high.) A
step whose constant must be worked out (arith) writes that sum first at high and max, as the
general domain does; at low it is done in the head.

Train, dev and test never share a function (`mopd.envs.splits`): a task's key is the hash of its
reference code, which fixes the function and so its examples and tests; the key puts it in exactly
one split. Each split draws from an RNG derived from (split, seed, index) and keeps only functions of
its own split. A small space splits coarsely: the tiny recipe's difficulty 1 has a few dozen
functions per family, so a split may hold one or two of a family (or none: then sampling that split
fails with an error naming the family). The key is `task.meta["content_hash"]`.

Verification never trusts the program. The sandboxed child receives only the code, the entry
name, the hidden INPUTS and a per-run nonce; it calls `f` on each input and writes one
nonce-tagged record of plain JSON values. The expected outputs never enter the sandbox: the
parent parses the record (plain data only, whatever the child did to its own json or builtins)
and compares it, type-strictly, to the expected outputs. Exit status, prints, exceptions and
objects with a lying `__eq__` therefore cannot make a pass; only the right values can.
"""

from __future__ import annotations

import json
import marshal
import random
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.sandbox import Limits, Program, RunResult, Sandbox
from mopd.envs.splits import check_split, content_hash, split_of, trainable

FAMILIES = ("list_pipeline", "list_reduce", "string_ops", "string_count", "sequence", "poly", "arith", "linear")
MAX_DRAWS = 1000
ALPHABET = "abcdeo"  # few letters, so replace/count steps usually hit something
ATTEMPTS = {"low": 1, "high": 2, "max": 3}


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


@dataclass
class Attempts:
    """One code episode: the assistant's attempts and the observations on their examples."""

    task: Task
    turns: list[dict[str, str]] = field(default_factory=list)
    done: bool = False

    @property
    def attempts(self) -> int:
        return sum(turn["role"] == "assistant" for turn in self.turns)

    @property
    def completion(self) -> str:
        """The last attempt: the one the hidden tests judge."""
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")


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
        allow_degraded: bool = False,
        attempts: dict[str, int] | None = None,
        retry_demos: float = 0.0,
        arith_start: tuple[int, int] = (0, 5),
        arith_step: tuple[int, int] = (1, 4),
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
        self.attempts = {**ATTEMPTS, **(attempts or {})}
        if set(self.attempts) != set(EFFORTS) or any(not isinstance(n, int) or n < 1 for n in self.attempts.values()):
            raise ValueError(f"code: attempts must give each of {list(EFFORTS)} a whole number >= 1, got {attempts}")
        if not 0.0 <= retry_demos <= 1.0:
            raise ValueError(f"code: retry_demos is a fraction in [0, 1], got {retry_demos}")
        self.retry_demos = retry_demos
        for name, (low, high) in (("arith_start", arith_start), ("arith_step", arith_step)):
            if not 0 <= low <= high or (name == "arith_step" and low < 1):
                raise ValueError(f"code: {name} must be (low, high) with {int(name == 'arith_step')} <= low <= high, got {(low, high)}")
        self.builders = family_builders(tuple(arith_start), tuple(arith_step))
        self.sandbox_options = {
            "workers": workers, "limits": limits, "backend": backend, "allow_degraded": allow_degraded
        }
        self._sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(**self.sandbox_options)
        return self._sandbox

    # ------------------------------------------------------------------------------ sampling
    def sample(self, n: int, seed: int, split: str = "train", effort: str = "high") -> list[Task]:
        check_split(split)
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
            function = self.builders[family](rng, rng.randint(*self.difficulty))
            if split_of(content_hash(function.source)) == split:
                return function
        raise ValueError(
            f"code/{family}: difficulty {self.difficulty} leaves too few distinct {split} functions "
            f"({MAX_DRAWS} draws found none)"
        )

    # ------------------------------------------------------------------------------ episodes
    def reset(self, task: Task) -> Attempts:
        check_code_meta(task)
        return Attempts(task)

    def step(self, episode: Attempts, assistant_text: str) -> tuple[str | None, bool]:
        """Take one attempt; return (what the examples showed, or None, and whether it is over)."""
        return self.step_many([episode], [assistant_text])[0]

    def step_many(self, episodes: list[Attempts], texts: list[str]) -> list[tuple[str | None, bool]]:
        """`step` for many episodes at once: their examples run in parallel in the sandbox."""
        for episode, text in zip(episodes, texts, strict=True):
            if episode.done:
                raise ValueError(f"episode of task {episode.task.id} is over; reset to continue")
            episode.turns.append({"role": "assistant", "content": text})
        checked = [e for e in episodes if e.attempts < self.attempts[e.task.effort]]
        observations = self.run_examples([e.task for e in checked], [e.completion for e in checked])
        shown = dict(zip(map(id, checked), observations))
        outcomes = []
        for episode in episodes:
            observation = shown.get(id(episode))
            if observation is None:
                episode.done = True
            else:
                episode.turns.append({"role": "observation", "content": observation})
            outcomes.append((observation, episode.done))
        return outcomes

    def run_examples(self, tasks: list[Task], completions: list[str]) -> list[str | None]:
        """Per completion, None when its code passes the prompt's examples, else what went wrong.

        A turn without a closed think block gets None too: it ends the episode (and scores 0);
        so does a task without examples (a user's task file may give only hidden tests).
        """
        shown: list[str | None] = []
        jobs: dict[int, tuple[str, Task]] = {}
        for i, (task, completion) in enumerate(zip(tasks, completions, strict=True)):
            code = extract_code(completion)
            if split_thinking(completion) is None or not task.meta.get("examples"):
                shown.append(None)
            elif isinstance(code, Verdict):
                shown.append(f"error: {code.details['reason']}")
            else:
                shown.append(None)  # until the sandbox says otherwise, below
                jobs[i] = (code, replace(task, meta={**task.meta, "tests": task.meta["examples"]}))
        for i, (result, nonce) in zip(jobs, self.run_harnesses(list(jobs.values()))):
            examples = tasks[i].meta["examples"]
            shown[i] = failures(examples, read_cases(result, nonce, len(examples)))
        return shown

    def replay(self, task: Task, transcript: list[dict[str, str]]) -> Attempts:
        """Re-run a transcript's attempts; its observations are ignored (the sandbox says them again)."""
        return self.replay_many([task], [transcript])[0]

    def replay_many(self, tasks: list[Task], transcripts: list[list[dict[str, str]]]) -> list[Attempts]:
        """`replay` for many transcripts, a turn at a time: each turn's examples run in parallel
        (the tiny base's data preparation replays ~600 transcripts with retries)."""
        episodes = [self.reset(task) for task in tasks]
        turns = [[t["content"] for t in transcript if t.get("role") == "assistant"] for transcript in transcripts]
        for k in range(max(map(len, turns), default=0)):
            going = [j for j, episode in enumerate(episodes) if k < len(turns[j]) and not episode.done]
            self.step_many([episodes[j] for j in going], [turns[j][k] for j in going])
        return episodes

    # ------------------------------------------------------------------------------- solving
    def solve(self, task: Task) -> str | list[dict[str, str]]:
        """The expert's completion; with `retry_demos`, sometimes a failed attempt comes first."""
        function = function_from_meta(task.meta)
        right = completion_of(function, task.meta["examples"], task.effort)
        demo = random.Random(f"retry:{task.id}").random() < self.retry_demos
        wrong = self.failed_attempt(function, task) if demo and self.attempts[task.effort] > 1 else None
        if wrong is None:
            return right
        text, observation = wrong
        return [{"role": "assistant", "content": text}, {"role": "observation", "content": observation},
                {"role": "assistant", "content": right}]

    def failed_attempt(self, function: Function, task: Task, tries: int = 20) -> tuple[str, str] | None:
        """A plausible wrong attempt that fails the examples, and the observation it gets.

        The wrong function is the right one with one digit of a step changed (a slip of the hand)
        or another train function of the family, drawn from the env's builder table, whichever fails
        first; a slip that lands on a dev or test function is passed over (`trainable`). It is our own
        generated code, so it runs here; what it returns goes through JSON as a sandboxed run's values
        would. None when nothing tried fails the examples (`f([-8]) == 0` says little).
        """
        rng = random.Random(f"wrong:{task.id}")
        examples = task.meta["examples"]
        for attempt in range(tries):
            wrong = (attempt % 2 == 0 and slip(function, rng)) or self._draw_function(task.meta["family"], "train", rng)
            if not trainable([content_hash(wrong.source)]):
                continue
            try:
                run = compile_reference(wrong.source)
                cases = [{"ok": json.loads(json.dumps(run(*case["args"])))} for case in examples]
            except Exception:  # a changed digit can make a constant Python refuses (07) or a bad index
                continue
            observation = failures(examples, cases)
            if observation is not None:
                return completion_of(wrong, examples, task.effort), observation
        return None

    # ----------------------------------------------------------------------------- verifying
    def verify(self, task: Task, attempt: Attempts | list[dict[str, str]] | str) -> Verdict:
        """Judge the last attempt of an episode or a transcript, or a single completion."""
        return self.verify_many([task], [attempt])[0]

    def verify_many(self, tasks: list[Task], attempts: list[Attempts | list[dict[str, str]] | str]) -> list[Verdict]:
        """`verify` for a batch; the sandbox runs the programs (and the transcripts' replays) in parallel."""
        for task in tasks:
            check_code_meta(task)
        verdicts: list[Verdict | None] = []
        jobs: dict[int, tuple[str, Task]] = {}
        for i, (task, attempt) in enumerate(zip(tasks, self.replayed(tasks, attempts), strict=True)):
            code = extract_code(attempt.completion if isinstance(attempt, Attempts) else attempt)
            verdicts.append(code if isinstance(code, Verdict) else None)
            if not isinstance(code, Verdict):
                jobs[i] = (code, task)
        for i, (result, nonce) in zip(jobs, self.run_harnesses(list(jobs.values()))):
            verdicts[i] = score(tasks[i], result, nonce, self.sandbox.backend)
        return verdicts  # type: ignore[return-value]

    def replayed(self, tasks: list[Task], attempts: list) -> list[Attempts | str]:
        """The attempts with every transcript (a list of turns) replayed into an episode."""
        transcripts = {i: attempt for i, attempt in enumerate(attempts) if isinstance(attempt, list)}
        episodes = self.replay_many([tasks[i] for i in transcripts], list(transcripts.values()))
        replayed = list(attempts)
        for i, episode in zip(transcripts, episodes):
            replayed[i] = episode
        return replayed

    def run_harnesses(self, jobs: list[tuple[str, Task]]) -> list[tuple[RunResult, str]]:
        """Run each code on its task's tests in the sandbox, in parallel: (result, the run's nonce)."""
        nonces = [secrets.token_hex(16) for _ in jobs]
        programs = [harness_program(code, task, nonce) for (code, task), nonce in zip(jobs, nonces)]
        return list(zip(self.sandbox.run_many(programs), nonces))

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


def arithmetic_sequence(
    rng: random.Random, starts: tuple[int, int] = (0, 5), steps: tuple[int, int] = (1, 4), stated: bool = False
) -> Step:
    """Term n of start + n * step: shown by its first three terms (the step to derive), or `stated` in words."""
    start, step = rng.randint(*starts), rng.randint(*steps)
    code = f"y = {linear(step, start, 'n')}"
    if stated:
        return Step(f"return term n (counting from 0) of the sequence that starts at {start} and adds {step} each time", code, "y")
    terms = ", ".join(str(start + i * step) for i in range(3))
    return Step(f"return term n (counting from 0) of the sequence that begins {terms}", code, "y", f"{start + step}-{start}={step}")


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


def arith_function(
    rng: random.Random, starts: tuple[int, int] = (0, 5), steps: tuple[int, int] = (1, 4), stated: bool = False
) -> Function:
    return Function("n", "int", "int", (arithmetic_sequence(rng, starts, steps, stated),))


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


# ------------------------------------------------------------------------------------ traces
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


DEFINITION = re.compile(r"^def\s+\w+\s*\(.*?(?=^def\s|\Z)", re.DOTALL | re.MULTILINE)


def contents(text: str) -> set[str]:
    """The functions a text states: each definition with a body in a fenced code block, keyed as a
    task's function is (`content_hash` of its source, whitespace and case aside)."""
    return {
        content_hash(definition.strip())
        for block in FENCED.findall(text)
        for definition in DEFINITION.findall(block)
        if "return" in definition
    }


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


def read_cases(result: RunResult, nonce: str, expected: int) -> list[dict] | str:
    """The child's one nonce-tagged record, parsed as plain data: a result per input, or why not."""
    records = [line[len(nonce) :] for line in result.stdout.splitlines() if line.startswith(nonce)]
    if len(records) != 1:
        return f"{len(records)} result records (need exactly 1)"
    try:
        record = json.loads(records[0])
    except (ValueError, RecursionError):
        return "unreadable result record"
    cases = record.get("cases") if isinstance(record, dict) else None
    if not isinstance(cases, list) or len(cases) != expected:
        error = record.get("error") if isinstance(record, dict) else None
        return str(error or "malformed result record")[:500]
    return cases


def score(task: Task, result: RunResult, nonce: str, backend: str) -> Verdict:
    """Compare the child's record to the expected outputs."""
    tests = task.meta["tests"]
    details: dict[str, Any] = {
        "status": result.status,
        "returncode": result.returncode,
        "sandbox": backend,
        "passed": 0,
        "total": len(tests),
    }
    cases = read_cases(result, nonce, len(tests))
    if isinstance(cases, str):
        return Verdict(0.0, {**details, "reason": cases, "stderr": result.stderr[-500:]})
    outcomes = [same_value(case, test["expected"]) for case, test in zip(cases, tests)]
    details["passed"] = sum(outcomes)
    if not all(outcomes):
        first = outcomes.index(False)
        details["failed"] = {"args": tests[first]["args"], "got": str(cases[first])[:300]}
    return Verdict(float(all(outcomes)), details)


def failures(examples: list[dict], cases: list[dict] | str) -> str | None:
    """What running the examples showed, a line per failing one; None when they all pass."""
    if isinstance(cases, str):
        return f"error: {cases}"
    lines = []
    for case, example in zip(cases, examples):
        call = f"f({', '.join(repr(arg) for arg in example['args'])})"
        if not isinstance(case, dict) or "ok" not in case:
            lines.append(f"{call} raised {str(case.get('error') if isinstance(case, dict) else case)[:200]}")
        elif not same_value(case, example["expected"]):
            lines.append(f"{call} returned {case['ok']!r}, expected {example['expected']!r}")
    return "\n".join(lines) or None


def same_value(case: Any, expected: Any) -> bool:
    """Type-strict equality of plain JSON data (1, 1.0 and True differ)."""
    if not isinstance(case, dict) or "ok" not in case:
        return False
    return json.dumps(case["ok"], sort_keys=True) == json.dumps(expected, sort_keys=True)
