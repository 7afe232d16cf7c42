"""The small interfaces every task domain shares: a task, a verdict, an environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Domain = Literal["general", "agent", "code"]
Effort = Literal["low", "high", "max"]
DOMAINS: tuple[str, ...] = ("general", "agent", "code")
EFFORTS: tuple[str, ...] = ("low", "high", "max")
Split = Literal["train", "dev", "test"]  # see mopd.envs.splits

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Task:
    """One problem. `meta` holds what the verifier needs (answer, hidden tests, db spec...)."""

    id: str
    domain: str
    effort: str
    prompt: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.reward >= 1.0


class Env(Protocol):
    domain: str

    def sample(self, n: int, seed: int, split: Split = "train", effort: str = "high") -> list[Task]: ...

    def verify(self, task: Task, completion: str) -> Verdict: ...


def split_thinking(completion: str) -> tuple[str, str] | None:
    """Split an assistant completion into (thinking, answer); None when the think block is not closed.

    The completion starts inside the assistant turn. The opening tag is optional because the
    chat template may already have emitted it as part of the prompt.
    """
    head, sep, answer = completion.partition(THINK_CLOSE)
    if not sep:
        return None
    return head.strip().removeprefix(THINK_OPEN).strip(), answer.strip()
