"""GeneralEnv: sampling questions by split (own families and reasoning-gym), verification of the
answer after `</think>`, and the expert's completions with the work each effort writes out."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.general.families import DEFAULT_FAMILIES, OWN_FAMILIES, OWN_GENERATORS, TRACES
from mopd.envs.general.questions import contents, evaluate, normalize_answer, question_for, task_key
from mopd.envs.general.rg import RG_CHUNK, RG_PREFIX, _config_key, _rg_create, _rg_dataset, _verify_rg
from mopd.envs.splits import check_split, split_of, trainable

MAX_DRAWS = 1000


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


def _checked_range(name: str, bounds: tuple[int, int], low: int = 1) -> tuple[int, int]:
    lo, hi = bounds
    if not (low <= lo <= hi):
        raise ValueError(f"general: {name}={bounds} must satisfy {low} <= min <= max")
    return int(lo), int(hi)


def max_digits(terms: list[int]) -> int:
    """Digits of the longest term."""
    return max(len(str(abs(term))) for term in terms)
