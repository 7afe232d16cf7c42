"""What a task family is, and the phrasing helpers the families share."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mopd.envs.agent.expert import _Session

# Each family: make(rng, conn, lookups) -> goal or None (this database does not fit);
# prompt(goal) -> str; apply(conn, goal) -> the answer for questions, else None after
# writing the intended change; solve(session, goal) plays the expert's episode.


@dataclass(frozen=True)
class Family:
    make: Callable[[random.Random, sqlite3.Connection, int], dict[str, Any] | None]
    prompt: Callable[[dict[str, Any]], str]
    apply: Callable[[sqlite3.Connection, dict[str, Any]], int | None]
    solve: Callable[[_Session, dict[str, Any]], None]


def sql_list(values: list[Any]) -> str:
    return ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in values)


def spoken_list(values: list[str], quote: str = "'") -> str:
    quoted = [f"{quote}{v}{quote}" for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"
