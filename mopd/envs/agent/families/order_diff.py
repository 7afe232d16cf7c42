"""order_diff: how many more orders one customer placed than others together (a question)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, spoken_list, sql_list

ORDER_DIFF_DRAWS = 200


def _make_order_diff(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    """A customer with at most nine orders against `lookups` others who together placed fewer.
    Many draws per database: of four customers drawn at random few qualify, and with 20 draws only
    13% of the tasks of `max_lookups: 3` compared four customers (28% with 200)."""
    counts = dict(conn.execute("SELECT customer_id, COUNT(*) FROM orders GROUP BY customer_id"))
    for _ in range(ORDER_DIFF_DRAWS):
        chosen = sorted(rng.sample(sorted(counts), lookups + 1), key=counts.get, reverse=True)
        more, fewer = chosen[0], chosen[1:]
        if sum(counts[c] for c in fewer) < counts[more] <= 9:
            return {"more": more, "fewer": fewer}
    return None


def _prompt_order_diff(goal: dict[str, Any]) -> str:
    others = [f"#{c}" for c in goal["fewer"]]
    than = f"customer {others[0]}" if len(others) == 1 else f"customers {spoken_list(others, quote='')} together"
    return f"How many more orders did customer #{goal['more']} place than {than}? Answer with the number only."


def _apply_order_diff(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    count = "SELECT COUNT(*) FROM orders WHERE customer_id = ?"
    more = conn.execute(count, (goal["more"],)).fetchone()[0]
    return more - sum(conn.execute(count, (c,)).fetchone()[0] for c in goal["fewer"])


def _solve_order_diff(s: _Session, goal: dict[str, Any]) -> None:
    """One query counts every customer's orders, the largest count first; then one-digit
    subtractions, one line each: all done in the head at low, the first written out at high (the
    rest in the head), every one written out at max.

    When high wrote only a lone subtraction, the tiny base scored the same at low and high (0.26 /
    0.25 on 256 tasks): writing one subtraction did not help, keeping two or more in the head is
    what fails. So each effort leaves a different number in the head (all, all but one, none):
    this is where effort pays in the agent domain. One query, not a COUNT per
    customer: with two, the tiny base lost track at low effort of whom it had already counted (it
    asked for the same customer again in 44 of 64 samples).
    """
    ids = [goal["more"], *goal["fewer"]]
    rows = s.query(s.think(high=f"I count the orders of {spoken_list([f'#{c}' for c in ids], quote='')}, "
                                "the largest count first.",
                           lead="GROUP BY gives all the counts in one query."),
                   f"SELECT customer_id, COUNT(*) FROM orders WHERE customer_id IN ({sql_list(ids)}) "
                   "GROUP BY customer_id ORDER BY COUNT(*) DESC")
    counts = [int(count) for _, count in rows]
    lines, left = [], counts[0]
    for count in counts[1:]:
        lines.append(f"{left}-{count}={left - count}")
        left -= count
    work = "\n".join(lines)
    placed = spoken_list([f"#{customer} placed {count}" for customer, count in rows], quote="")
    first_step = lines[0] if s.effort == "high" else ""  # max writes them all after the lead
    s.finish(s.think(high=first_step, max=work, lead=f"{placed}."), left)


FAMILY = Family(_make_order_diff, _prompt_order_diff, _apply_order_diff, _solve_order_diff)
