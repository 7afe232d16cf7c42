"""order_total: the total value of the orders of one or more customers (a question)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, spoken_list, sql_list


def _make_order_total(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any]:
    names = [name for (name,) in conn.execute(
        "SELECT name FROM customers WHERE id IN (SELECT customer_id FROM orders) ORDER BY id")]
    return {"customers": rng.sample(names, min(lookups, len(names)))}


def _prompt_order_total(goal: dict[str, Any]) -> str:
    who = spoken_list(goal["customers"])
    together = " together" if len(goal["customers"]) > 1 else ""
    return (f"What is the total value (quantity times unit price, summed over all orders) of the orders "
            f"placed by {'customers' if together else 'customer'} {who}{together}? Answer with the number only.")


def _apply_order_total(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    return conn.execute(
        "SELECT SUM(o.quantity * o.unit_price) FROM orders o JOIN customers c ON c.id = o.customer_id "
        f"WHERE c.name IN ({sql_list(goal['customers'])})").fetchone()[0]


def _solve_order_total(s: _Session, goal: dict[str, Any]) -> None:
    names = sql_list(goal["customers"])
    if s.effort == "low":
        rows = s.query("", "SELECT SUM(o.quantity * o.unit_price) FROM orders o JOIN customers c "
                           f"ON c.id = o.customer_id WHERE c.name IN ({names})")
        return s.finish("", rows[0][0])
    ids = [row[0] for row in s.query(
        f"I need the id of each customer ({names}), then the sum of quantity × unit_price over their orders.",
        f"SELECT id, name FROM customers WHERE name IN ({names})")]
    id_list = ", ".join(ids)
    total_sql = f"SELECT SUM(quantity * unit_price) FROM orders WHERE customer_id IN ({id_list})"
    if s.effort == "high":
        total = s.query(f"The customer ids are {id_list}. Now I sum their orders.", total_sql)[0][0]
        return s.finish(f"The orders add up to {total}.", total)
    lines = s.query(f"The customer ids are {id_list}. I will list every order and add them up myself, "
                    "then check the sum with SQL.",
                    f"SELECT id, quantity, unit_price FROM orders WHERE customer_id IN ({id_list}) ORDER BY id")
    running, steps = 0, []
    for order_id, quantity, price in lines:
        running += int(quantity) * int(price)
        steps.append(f"order {order_id}: {quantity} × {price} = {int(quantity) * int(price)}; running total {running}.")
    total = s.query("\n".join([*steps, f"By hand the total is {running}. Let me confirm with SQL."]), total_sql)[0][0]
    verdict = "they agree" if int(total) == running else "they differ, so I trust the SQL sum"
    s.finish(f"SQL gives {total} and my sum gives {running}: {verdict}. The answer is {total}.", total)


FAMILY = Family(_make_order_total, _prompt_order_total, _apply_order_total, _solve_order_total)
