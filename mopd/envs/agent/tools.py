"""The agent's tool protocol in today's harness (the `mopd` scaffold; `scaffolds` has every
harness): the tool call in an answer, the rows of an observation, and the number of a final answer."""

from __future__ import annotations

import re

from mopd.envs.agent.harness import ToolCallError
from mopd.envs.agent.scaffolds import MOPD

__all__ = ["ToolCallError", "find_tool_call", "parse_number", "parse_rows"]


def find_tool_call(answer: str) -> str | ToolCallError | None:
    """The SQL inside the answer's one tool call; None for a final answer."""
    return MOPD.find_call(answer)


def parse_rows(observation: str | None) -> list[list[str]]:
    """The rows of a result observation (header and footer dropped)."""
    return MOPD.rows_of(observation)


def parse_number(answer: str | None) -> int | None:
    """The final answer as an integer: the number alone, '$' and thousands separators allowed."""
    if answer is None:
        return None
    text = answer.strip().removeprefix("$").replace(",", "").removesuffix(".")
    return int(text) if re.fullmatch(r"-?\d+", text) else None
