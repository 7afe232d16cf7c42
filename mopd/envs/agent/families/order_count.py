"""order_count: how many orders one or more customers placed (a question)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, spoken_list, sql_list


def _make_order_count(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any]:
    ids = [cid for (cid,) in conn.execute("SELECT DISTINCT customer_id FROM orders ORDER BY customer_id")]
    return {"customer_ids": sorted(rng.sample(ids, min(lookups, len(ids))))}


def _prompt_order_count(goal: dict[str, Any]) -> str:
    ids = [f"#{cid}" for cid in goal["customer_ids"]]
    who = f"customer {ids[0]}" if len(ids) == 1 else f"customers {spoken_list(ids, quote='')} together"
    return f"How many orders were placed by {who}? Answer with the number only."


def _apply_order_count(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    return conn.execute(
        f"SELECT COUNT(*) FROM orders WHERE customer_id IN ({sql_list(goal['customer_ids'])})").fetchone()[0]


def _solve_order_count(s: _Session, goal: dict[str, Any]) -> None:
    ids = sql_list(goal["customer_ids"])
    # The max sentence goes before the ids, not between them and the SQL that copies them: placed
    # after, the tiny teacher's SQL named another customer (agent-max 0.29 against high 0.92).
    count = s.query(s.think(high=f"I count the orders with customer_id in ({ids}).",
                            lead="COUNT(*) gives the number of rows, so no listing is needed."),
                    f"SELECT COUNT(*) FROM orders WHERE customer_id IN ({ids})")[0][0]
    s.finish(s.think(high=f"There are {count} such orders.", max=f"The answer is {count}."), count)


FAMILY = Family(_make_order_count, _prompt_order_count, _apply_order_count, _solve_order_count)
