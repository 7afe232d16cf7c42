"""set_price: set a product's price to a multiple of other products' prices (a write)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, spoken_list, sql_list

FACTOR_WORDS = {2: "twice", 3: "three times"}


def _make_set_price(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    prices = dict(conn.execute("SELECT name, price FROM products ORDER BY id"))
    target, *sources = rng.sample(sorted(prices), lookups + 1)
    factor = rng.choice(sorted(FACTOR_WORDS))
    if factor * sum(prices[name] for name in sources) == prices[target]:
        return None  # doing nothing would already be right
    return {"target": target, "sources": sources, "factor": factor}


def _prompt_set_price(goal: dict[str, Any]) -> str:
    sources = goal["sources"]
    of_what = f"the price of '{sources[0]}'" if len(sources) == 1 else f"the combined price of {spoken_list(sources)}"
    return f"Set the price of '{goal['target']}' to {FACTOR_WORDS[goal['factor']]} {of_what}."


def _apply_set_price(conn: sqlite3.Connection, goal: dict[str, Any]) -> None:
    total = conn.execute(f"SELECT SUM(price) FROM products WHERE name IN ({sql_list(goal['sources'])})").fetchone()[0]
    conn.execute("UPDATE products SET price = ? WHERE name = ?", (goal["factor"] * total, goal["target"]))


def _solve_set_price(s: _Session, goal: dict[str, Any]) -> None:
    target, factor, sources = goal["target"], goal["factor"], sql_list(goal["sources"])
    if s.effort == "low":
        s.write("", f"UPDATE products SET price = {factor} * (SELECT SUM(price) FROM products "
                    f"WHERE name IN ({sources})) WHERE name = '{target}'")
        return s.finish("", "Done.")
    rows = s.query(s.think(high=f"First I read the price of {sources}.",
                           max=f"Then the new price of '{target}' is {factor} × their sum; "
                               "I will check the write afterwards."),
                   f"SELECT name, price FROM products WHERE name IN ({sources})")
    total = sum(int(price) for _, price in rows)
    new_price = factor * total
    sum_text = " + ".join(price for _, price in rows)
    s.write(s.think(high=f"Their price sum is {total}, so '{target}' must cost {factor} × {total} = {new_price}.",
                    max=f"Spelled out: {sum_text} = {total}; {factor} × {total} = {new_price}."),
            f"UPDATE products SET price = {new_price} WHERE name = '{target}'")
    if s.effort == "max":
        s.query("One row should have changed. Let me read it back.",
                f"SELECT name, price FROM products WHERE name = '{target}'")
    s.finish(s.think(high="The update is done.", max=f"It reads back {new_price}, as intended."),
             f"Done: '{target}' now costs {new_price}.")


FAMILY = Family(_make_set_price, _prompt_set_price, _apply_set_price, _solve_set_price)
