"""CodeEnv: sampling functions by split, multi-attempt episodes run on the examples, the expert's
transcripts (with failed attempts at `retry_demos`) and batched verification in the sandbox."""

from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass, field, replace

from mopd.envs.base import EFFORTS, Task, Verdict, split_thinking
from mopd.envs.code.expert import completion_of, slip
from mopd.envs.code.families import FAMILIES, family_builders
from mopd.envs.code.function import (
    Function,
    compile_reference,
    edge_input,
    function_from_meta,
    prompt_for,
    random_input,
)
from mopd.envs.code.harness import harness_program, read_cases
from mopd.envs.code.verify import check_code_meta, extract_code, failures, score
from mopd.envs.sandbox import Limits, RunResult, SandboxOwner
from mopd.envs.splits import check_split, content_hash, split_of, trainable

MAX_DRAWS = 1000
ATTEMPTS = {"low": 1, "high": 2, "max": 3}


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


class CodeEnv(SandboxOwner):
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
        shown = dict(zip(map(id, checked), observations, strict=True))
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
        for i, (result, nonce) in zip(jobs, self.run_harnesses(list(jobs.values())), strict=True):
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
        for i, (result, nonce) in zip(jobs, self.run_harnesses(list(jobs.values())), strict=True):
            verdicts[i] = score(tasks[i], result, nonce, self.sandbox.backend)
        return verdicts  # type: ignore[return-value]

    def replayed(self, tasks: list[Task], attempts: list) -> list[Attempts | str]:
        """The attempts with every transcript (a list of turns) replayed into an episode."""
        transcripts = {i: attempt for i, attempt in enumerate(attempts) if isinstance(attempt, list)}
        episodes = self.replay_many([tasks[i] for i in transcripts], list(transcripts.values()))
        replayed = list(attempts)
        for i, episode in zip(transcripts, episodes, strict=True):
            replayed[i] = episode
        return replayed

    def run_harnesses(self, jobs: list[tuple[str, Task]]) -> list[tuple[RunResult, str]]:
        """Run each code on its task's tests in the sandbox, in parallel: (result, the run's nonce)."""
        nonces = [secrets.token_hex(16) for _ in jobs]
        programs = [harness_program(code, task, nonce) for (code, task), nonce in zip(jobs, nonces, strict=True)]
        return list(zip(self.sandbox.run_many(programs), nonces, strict=True))
