"""The agent's tool protocol: the tool call in an answer, observations of rows and errors, and the
number of a final answer."""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from mopd.envs.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class ToolCallError(str):
    """A malformed tool call, reported back to the model as an observation."""


def find_tool_call(answer: str) -> str | ToolCallError | None:
    """The SQL inside the answer's one tool call; None for a final answer."""
    opens, closes = answer.count(TOOL_CALL_OPEN), answer.count(TOOL_CALL_CLOSE)
    if opens == closes == 0:
        return None
    if opens != 1 or closes != 1 or answer.index(TOOL_CALL_OPEN) > answer.index(TOOL_CALL_CLOSE):
        return ToolCallError(f"write exactly one {TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE} per turn")
    return answer.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0].strip()


def _explain(error: sqlite3.Error) -> str:
    if str(error) == "interrupted":
        return "the statement ran too long and was stopped"
    if str(error) in ("not authorized", "authorization denied"):
        return "not authorized (only SELECT, INSERT, UPDATE and DELETE on the task's tables are allowed)"
    return str(error)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "…"


def parse_rows(observation: str | None) -> list[list[str]]:
    """The rows of a result observation (header and footer dropped)."""
    if observation is None or observation.startswith(("error:", "OK,")):
        raise ValueError(f"expected rows, got observation {observation!r}")
    return [line.split(" | ") for line in observation.splitlines()[1:-1]]


def parse_number(answer: str | None) -> int | None:
    """The final answer as an integer: the number alone, '$' and thousands separators allowed."""
    if answer is None:
        return None
    text = answer.strip().removeprefix("$").replace(",", "").removesuffix(".")
    return int(text) if re.fullmatch(r"-?\d+", text) else None
