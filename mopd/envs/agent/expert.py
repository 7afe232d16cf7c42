"""The agent's expert: a session that plays a family's solution against a real episode, in the
task's own scaffold."""

from __future__ import annotations

from typing import Any

from mopd.envs.agent.scaffolds import scaffold_of
from mopd.envs.base import Task


class _Session:
    """The expert talking to a real episode: each call is stepped and its observation parsed back."""

    def __init__(self, env: Any, task: Task):  # an AgentEnv, not named here: `env` imports this module
        self.env, self.effort = env, task.effort
        self.scaffold = scaffold_of(task.meta)
        self.episode = env.reset(task)

    def query(self, think: str, sql: str) -> list[list[str]]:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{self.scaffold.call(sql)}")
        return self.scaffold.rows_of(observation)

    def write(self, think: str, sql: str) -> None:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{self.scaffold.call(sql)}")
        if observation is None or self.scaffold.changed_count(observation) is None:
            raise RuntimeError(f"expert write failed: {sql!r} -> {observation!r}")

    def finish(self, think: str, answer: Any) -> None:
        self.env.step(self.episode, f"<think>{think}</think>{answer}")

    def think(self, low: str = "", high: str = "", max: str = "", lead: str = "") -> str:
        """The scratchpad for this effort: at max `lead` comes before `high` and `max` after it;
        low is short or empty."""
        return {"low": low, "high": high, "max": " ".join(t for t in (lead, high, max) if t)}[self.effort]
