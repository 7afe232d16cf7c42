"""GSM-style word problems: reasoning-gym's `gsm_symbolic` (templates of GSM8K problems with their
numbers redrawn, GSM-Symbolic, Mirzadeh et al. 2024), scored by the final number as GSM8K is.

The problems are the generator's output for the suite's `seed` and `size`, in order: the same
problems every run. An answer's final number is its last `\\boxed{…}`, else the last number it
writes (`$1,000.00`, `-3`, `7/2`); math-verify (HF's answer-equivalence library) decides whether it
equals the reference, so 70, 70.0, $70 and 1,000 = 1000 all count, and a number mentioned before
the final one does not.
"""

from __future__ import annotations

import re

from mopd.bench.external import answer_of
from mopd.envs.base import EFFORTS, Task, Verdict
from mopd.envs.splits import content_hash

GENERATOR = "gsm_symbolic"
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
INSTRUCTION = "{question}\nEnd with the final answer as a number on its own line: Answer: <number>"


class GSMEnv:
    domain = "gsm"

    def __init__(self, seed: int = 0, size: int = 200):
        if size < 1:
            raise ValueError(f"gsm: size must be >= 1, got {size}")
        self.seed, self.size = seed, size

    def tasks(self, effort: str, limit: int | None = None) -> list[Task]:
        """The generator's problems for (seed, size), in order (the first `limit`), asked at `effort`."""
        import reasoning_gym

        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {list(EFFORTS)}, got {effort!r}")
        count = min(self.size, limit or self.size)
        dataset = reasoning_gym.create_dataset(GENERATOR, size=self.size, seed=self.seed)
        return [task_of(dataset[i], f"gsm-{self.seed}-{i}", effort) for i in range(count)]

    def verify(self, task: Task, completion: str) -> Verdict:
        answer = answer_of(completion)
        if answer is None:
            return Verdict(0.0, {"reason": "think block not closed"})
        number = final_number(answer)
        if number is None:
            return Verdict(0.0, {"reason": "no number in the answer", "answer": answer[-200:]})
        return Verdict(float(same_number(number, task.meta["answer"])), {"final": number, "expected": task.meta["answer"]})

    def verify_many(self, tasks: list[Task], completions: list[str]) -> list[Verdict]:
        return [self.verify(task, completion) for task, completion in zip(tasks, completions, strict=True)]


def task_of(entry: dict, task_id: str, effort: str) -> Task:
    question, answer = entry["question"], str(entry["answer"])
    meta = {"answer": answer, "content_hash": content_hash(question, answer)}
    return Task(task_id, "gsm", effort, INSTRUCTION.format(question=question), meta)


def final_number(answer: str) -> str | None:
    """The answer's last `\\boxed{…}`, else its last number, without `$` and thousands commas."""
    boxed = BOXED.findall(answer)
    found = boxed[-1] if boxed else (NUMBER.findall(answer) or [None])[-1]
    return None if found is None else found.replace("$", "").replace(",", "").strip()


def same_number(number: str, expected: str) -> bool:
    """Equal as math-verify compares answers (70 = 70.0 = 140/2)."""
    from math_verify import parse, verify

    return verify(parse(expected, parsing_timeout=None), parse(number, parsing_timeout=None), timeout_seconds=None)
