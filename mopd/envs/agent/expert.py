"""The agent's expert: a session that plays a family's solution against a real episode."""

from __future__ import annotations

from typing import Any

from mopd.envs.agent.tools import parse_rows
from mopd.envs.base import Task
from mopd.envs.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class _Session:
    """The expert talking to a real episode: each call is stepped and its observation parsed back."""

    def __init__(self, env: Any, task: Task):  # an AgentEnv, not named here: `env` imports this module
        self.env, self.effort = env, task.effort
        self.episode = env.reset(task)

    def query(self, think: str, sql: str) -> list[list[str]]:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{TOOL_CALL_OPEN}{sql}{TOOL_CALL_CLOSE}")
        return parse_rows(observation)

    def write(self, think: str, sql: str) -> None:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{TOOL_CALL_OPEN}{sql}{TOOL_CALL_CLOSE}")
        if not (observation or "").startswith("OK,"):
            raise RuntimeError(f"expert write failed: {sql!r} -> {observation!r}")

    def finish(self, think: str, answer: Any) -> None:
        self.env.step(self.episode, f"<think>{think}</think>{answer}")

    def think(self, low: str = "", high: str = "", max: str = "", lead: str = "") -> str:
        """The scratchpad for this effort: at max `lead` comes before `high` and `max` after it;
        low is short or empty."""
        return {"low": low, "high": high, "max": " ".join(t for t in (lead, high, max) if t)}[self.effort]
